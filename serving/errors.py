"""The errors a request can meet before it runs, at the bottom of `serving` (every layer raises them)."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A malformed field or a request beyond a limit; `field` names it (INVALID_ARGUMENT)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class AdmissionError(RuntimeError):
    """The request was not admitted; `kind` is queue_full, duplicate_id, shutting_down or engine_failed."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind
