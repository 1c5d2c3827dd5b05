"""Errors that mean "the input is wrong": the trainer prints them without a traceback and
exits with code 2, on every rank."""


class ConfigError(ValueError):
    """A bad configuration or launch environment: the message names the key and the fix."""
