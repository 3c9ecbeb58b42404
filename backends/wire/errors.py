"""An error answer (`ApiError`) and the error bodies of each API: native, OpenAI's (on /v1 and
the tokenizer routes), Anthropic's (on /v1/messages). phi2_server.py's middleware renders them."""

from __future__ import annotations


class ApiError(Exception):
    """An error answer. `json_errors` renders it in the shape of the route's API."""

    def __init__(
        self,
        status: int,
        message: str,
        field: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
        headers: dict | None = None,
        close: bool = False,
    ):
        super().__init__(message)
        self.status, self.message, self.field, self.code = status, message, field, code
        self.close = close  # the connection cannot go on (a body left unread): closed after the answer
        self.headers = {**({"Retry-After": str(retry_after)} if retry_after else {}), **(headers or {})}


NATIVE_ERROR_TYPES = {
    400: "invalid_json",
    401: "unauthorized",
    408: "request_timeout",
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    422: "invalid_request",
    429: "rate_limited",
    503: "unavailable",
    504: "timeout",
}


OPENAI_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    408: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    401: "authentication_error",
    429: "rate_limit_error",
}


ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
