"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the matching status."""

from __future__ import annotations

import orjson


class ApiError(Exception):
    """An error the proxy answers itself, before or instead of a backend."""

    def __init__(
        self,
        status: int,
        message: str,
        err_type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: tuple[tuple[bytes, bytes], ...] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.code = code
        self.param = param
        # Headers of the answer beyond the body's (`www-authenticate`, `allow`).
        self.headers = headers

    def body(self) -> bytes:
        return error_body(self.message, self.err_type, self.code, self.param)


def error_body(message: str, err_type: str, code: str | None, param: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": err_type, "param": param, "code": code}})


def sse_error(message: str, code: str) -> bytes:
    """An error event for a stream that already started, then the end of the stream."""
    return b"data: " + error_body(message, "server_error", code) + b"\n\ndata: [DONE]\n\n"
