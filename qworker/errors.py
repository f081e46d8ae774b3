"""Typed errors. Bad user input raises one of these with a message that says what to fix."""


class QworkerError(Exception):
    """Base class for every error qworker raises on purpose."""


class InvalidRequestError(QworkerError, ValueError):
    """A request (prompt or sampling parameters) that can never be served as given."""


class InvalidParamsError(InvalidRequestError):
    """A sampling parameter outside its allowed range."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus at least one generated token) does not fit in the model's context."""


class UnknownModelError(QworkerError, ValueError):
    """The model name or path does not resolve to a model qworker can load."""
