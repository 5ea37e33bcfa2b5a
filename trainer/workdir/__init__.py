"""The work directory a run owns: where its files live (local or an object store),
the lock one run holds on it, and the config a finished run left there."""
