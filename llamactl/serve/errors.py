"""The API's error: an answer other than 200 with OpenAI's error object (its own module: the
request checks of protocol, grammar and tools all raise it)."""

from __future__ import annotations


class ApiError(Exception):
    """An answer other than 200: status, OpenAI's error object (message, type, param, code)."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
