"""Errors of the HTTP front end, in each API's own error body.

An `ApiError` carries the HTTP status, a message that names the field and the problem, and (OpenAI
routes) the `param`. The app renders it per route family: the OpenAI envelope
`{"error": {"message", "type", "param", "code"}}` on Chat Completions / Completions / Responses / models,
the Anthropic envelope `{"type": "error", "error": {"type", "message"}}` on the Messages routes (the
SDKs read these to raise their typed exceptions: openai.BadRequestError, anthropic.NotFoundError, ...).
"""

from __future__ import annotations

import json

# OpenAI-style `type`/`code` per status (the hosted API: `invalid_request_error` for request faults).
_OPENAI_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable_error",
}
_OPENAI_CODE = {401: "invalid_api_key", 404: "model_not_found", 429: "rate_limit_exceeded"}
# Anthropic's error types (its SDK maps the HTTP status; the type is for the client's logs).
_ANTHROPIC_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


class ApiError(Exception):
    """An HTTP error answer; `message` names the field and the problem, never holds a traceback."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def openai_body(self) -> dict:
        kind = _OPENAI_TYPE.get(
            self.status, "invalid_request_error" if self.status < 500 else "internal_error"
        )
        code = self.code or _OPENAI_CODE.get(self.status, kind)
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": code}}

    def anthropic_body(self) -> dict:
        kind = _ANTHROPIC_TYPE.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def body(self, anthropic: bool) -> dict:
        return self.anthropic_body() if anthropic else self.openai_body()


def from_conversion_error(status: int, body: str) -> ApiError:
    """deepseek-recipe's ConversionError (status + an OpenAI error body as JSON text) as an ApiError.

    The library answers 400 for every validation failure; its message is kept verbatim (the hosted API's
    wording), and its `param` when it names one.
    """
    message, param = body, None
    try:
        err = json.loads(body)["error"]
        message = str(err.get("message") or body)
        param = err.get("param")
    except (ValueError, KeyError, TypeError, AttributeError):
        pass
    if not 400 <= status < 600:
        status = 400
    return ApiError(status, message, param=param if isinstance(param, str) else None)
