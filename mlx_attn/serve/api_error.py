"""The server's one error type: answered as OpenAI-style JSON with an HTTP status."""

from __future__ import annotations

__all__ = ["APIError"]


class APIError(Exception):
    """An error answered as OpenAI-style JSON with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status == 401:
            kind = "authentication_error"
        # a lone surrogate from a request would not encode as UTF-8 in the response
        message = self.message.encode("utf-8", "backslashreplace").decode("utf-8")
        return {"error": {"message": message, "type": kind, "param": self.param, "code": self.code}}
