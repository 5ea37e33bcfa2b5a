"""The process around a command: its set-up, flags and one-line errors, the console,
SIGTERM and Ctrl-C, the cluster it joins, and fault injection. Commands set the
process up through here; the rest of the library changes no interpreter state."""
