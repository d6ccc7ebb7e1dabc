"""The one error type for bad input: the CLI prints its message as one line and exits 2."""


class ConfigError(ValueError):
    """Bad input, found before any work starts. The message names every number involved."""
