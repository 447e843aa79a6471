"""Errors a user can act on. The CLI prints their message as one line; the server maps them to 4xx."""


class EagletError(Exception):
    """Base class: the message alone must tell the user what is wrong."""


class ModelLoadError(EagletError):
    """A model or drafter could not be loaded: missing path, unknown format, missing/unknown tensor."""


class InvalidInput(EagletError):
    """A request or flag is out of range: prompt longer than the context, bad sampling parameter."""
