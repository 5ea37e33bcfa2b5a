"""Errors a user causes (not bugs): each is reported as one ``error:`` line, no traceback.

Every such error derives from :class:`UserError`; the command-line entry points catch
that base alone (:func:`trainer.command.cli.clear_errors`).
"""

from __future__ import annotations

from typing import Any


class UserError(Exception):
    """Something the user can fix: the config, the data, the work directory, the
    learning rate. The message says what, with the numbers."""

    # Print nothing after the error line: writes still ending in the background
    # (a failed save's) would print tracebacks after it.
    last_words = False
    # Leave without Python's exit (atexit handlers, joining threads): after a peer
    # died, Orbax's and JAX's threads would wait for it.
    exit_at_once = False


class ConfigError(UserError, ValueError):
    """The config asks for something that cannot run; the message says what."""


def floating_dtype(value: Any, key: str) -> Any:
    """The floating-point dtype config key ``key`` names (e.g. ``model.dtype``).

    Raises:
      ConfigError: naming the key, if ``value`` is not a floating-point dtype.
    """
    import jax.numpy as jnp  # noqa: PLC0415  (this module stays importable without jax)

    try:
        dtype = jnp.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ConfigError(
            f"{key}='{value}' is not a floating-point dtype (e.g. float32, bfloat16, float16)"
        )
    return dtype
