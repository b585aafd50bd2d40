"""RFC 9457 problem details: every error the service answers is `application/problem+json`."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from pnmix.storage.errors import InvalidValueError, NoFeasiblePointError, NotFoundError, StorageError

PROBLEM_JSON = "application/problem+json"
log = logging.getLogger("pnmix.api")


class Problem(BaseModel):
    """An RFC 9457 problem. Extension members (e.g. `errors`, `smallest_feasible_bits`) may follow."""

    model_config = ConfigDict(extra="allow")

    type: str = Field(default="about:blank", description="URI reference naming the problem type")
    title: str
    status: int
    detail: str | None = None
    instance: str | None = None


class ProblemError(Exception):
    """Raised by routes; rendered as a problem response."""

    def __init__(
        self,
        status: int,
        title: str,
        detail: str | None = None,
        type_: str = "about:blank",
        headers: dict[str, str] | None = None,
        **extensions: Any,
    ) -> None:
        super().__init__(detail or title)
        self.status, self.title, self.detail, self.type = status, title, detail, type_
        self.headers = headers or {}
        self.extensions = extensions


def problem_response(
    request: Request,
    status: int,
    title: str,
    detail: str | None = None,
    type_: str = "about:blank",
    headers: dict[str, str] | None = None,
    **extensions: Any,
) -> JSONResponse:
    body: dict[str, Any] = {"type": type_, "title": title, "status": status}
    if detail is not None:
        body["detail"] = detail
    body["instance"] = request.url.path
    body.update(extensions)
    return JSONResponse(body, status_code=status, media_type=PROBLEM_JSON, headers=headers)


def problem_doc(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses=` entries documenting problem bodies for these statuses."""
    return {
        status: {
            "description": _TITLES.get(status, "Error"),
            "content": {PROBLEM_JSON: {"schema": {"$ref": "#/components/schemas/Problem"}}},
        }
        for status in statuses
    }


_TITLES = {
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    409: "Conflict",
    413: "Content Too Large",
    415: "Unsupported Media Type",
    431: "Request Header Fields Too Large",
    422: "Unprocessable Content",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


def install(app: FastAPI) -> None:
    async def on_problem(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ProblemError)
        return problem_response(request, exc.status, exc.title, exc.detail, exc.type, exc.headers, **exc.extensions)

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        headers = dict(exc.headers) if exc.headers else None
        detail = exc.detail if isinstance(exc.detail, str) else None
        title = _TITLES.get(exc.status_code, "Error")
        return problem_response(request, exc.status_code, title, detail if detail != title else None, headers=headers)

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        errors = [
            {"loc": [str(p) for p in err.get("loc", ())], "msg": str(err.get("msg", "")), "type": str(err.get("type"))}
            for err in exc.errors()
        ]
        first = errors[0] if errors else {"loc": [], "msg": "invalid request"}
        where = ".".join(first["loc"][1:] if len(first["loc"]) > 1 else first["loc"])
        detail = f"{where}: {first['msg']}" if where else str(first["msg"])
        return problem_response(request, 422, "Unprocessable Content", detail, errors=errors)

    async def on_storage(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, NoFeasiblePointError):
            return problem_response(
                request, 404, "No feasible configuration", str(exc), type_="urn:pnmix:problem:no-feasible-point",
                model=exc.model, target_bits=exc.target_bits, min_accuracy=exc.min_accuracy,
                smallest_feasible_bits=exc.smallest_bits,
            )
        if isinstance(exc, NotFoundError):
            return problem_response(request, 404, "Not Found", str(exc))
        if isinstance(exc, InvalidValueError):
            return problem_response(request, 422, "Unprocessable Content", str(exc))
        log.error("storage error on %s %s: %s", request.method, request.url.path, exc)
        return problem_response(request, 503, "Service Unavailable", "the database is not available")

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return problem_response(request, 500, "Internal Server Error", "an unexpected error occurred")

    app.add_exception_handler(ProblemError, on_problem)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StorageError, on_storage)
    app.add_exception_handler(Exception, on_unexpected)
