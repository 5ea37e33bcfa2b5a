"""The error a user causes through the config: reported as one line, no traceback."""


class ConfigError(ValueError):
    """The config asks for something that cannot run; the message says what."""
