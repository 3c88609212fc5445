"""Error types shared by every process. Each carries the HTTP status it maps to (docs/design.md, Errors)."""

from __future__ import annotations


class FlareError(Exception):
    status = 500
    kind = "server_error"

    def __init__(self, message: str, hint: str = "", param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.param = param

    def display(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class InvalidRequest(FlareError):
    status = 400
    kind = "invalid_request_error"


class Unauthorized(FlareError):
    status = 401
    kind = "authentication_error"


class Forbidden(FlareError):
    status = 403
    kind = "permission_error"


class NotFound(FlareError):
    status = 404
    kind = "not_found_error"


class RequestTimeout(FlareError):
    status = 408
    kind = "invalid_request_error"


class BodyTooLarge(FlareError):
    status = 413
    kind = "invalid_request_error"


class UnsupportedMediaType(FlareError):
    status = 415
    kind = "invalid_request_error"


class FrontendBusy(FlareError):
    status = 429
    kind = "rate_limit_error"


class EngineUnavailable(FlareError):
    status = 503
    kind = "overloaded_error"


class ExecutionFailed(FlareError):
    status = 500
    kind = "server_error"


class CoreError(Exception):
    """A core (or an ignition source) that cannot be used: the message names the file."""


def error_for_status(status: int, message: str, hint: str = "") -> FlareError:
    classes = {c.status: c for c in (InvalidRequest, Unauthorized, Forbidden, NotFound, RequestTimeout, BodyTooLarge,
                                     UnsupportedMediaType, FrontendBusy, EngineUnavailable)}
    return classes.get(status, ExecutionFailed)(message, hint)
