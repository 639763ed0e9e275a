"""Errors a user can cause and fix. The CLI prints their message as one line, no traceback."""


class SpecdraftError(Exception):
    """Bad input, a missing or corrupt file, a model or drafter that does not fit."""
