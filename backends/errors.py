"""The errors the contract names (backends/contract.py re-exports them): the rooms below it raise
them without importing the contract itself."""

from __future__ import annotations


class ModelLoadError(RuntimeError):
    """The configured model (or adapter) cannot be loaded; the message says what to do."""


class ChatError(ValueError):
    """A chat the model's template cannot render (its own raise_exception, or a template variable
    a request may not set); the message says which, `field` the request's field to name."""

    def __init__(self, message: str, field: str = "messages"):
        super().__init__(message)
        self.field = field


class GrammarError(ValueError):
    """A JSON Schema or regex that cannot constrain generation; the message is the grammar
    library's reason."""
