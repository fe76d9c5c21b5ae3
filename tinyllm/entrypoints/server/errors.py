"""Every failure reaches the client in OpenAI's shape ({"error": {message, type, param, code}}),
or in the shape a dialect registered for its routes with `add_error_shape`."""

import logging
import re
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tinyllm.entrypoints.server.protocol import error_body

log = logging.getLogger("tinyllm.server")

_TYPES = {401: "authentication_error", 404: "not_found_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def type(self) -> str:
        if self.status >= 500 and self.status != 503:
            return "server_error"
        return _TYPES.get(self.status, "invalid_request_error")

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


# An APIError as a dialect's error body.
ErrorShape = Callable[[APIError], dict]


def add_error_shape(app: FastAPI, prefix: str, shape: ErrorShape) -> None:
    """Errors on `prefix` and the paths under it are answered in `shape`'s body."""
    app.state.error_shapes[prefix] = shape


def error_response(app: FastAPI, path: str, exc: APIError) -> JSONResponse:
    """`exc` in the shape of the dialect that owns `path` (OpenAI's by default)."""
    for prefix, shape in app.state.error_shapes.items():
        if path == prefix or path.startswith(prefix + "/"):
            return JSONResponse(shape(exc), status_code=exc.status)
    return exc.response()


def invalid_params(e: ValueError) -> APIError:
    """A 400 for a ValueError from SamplingParams or the engine, naming the field when it can."""
    m = re.match(r"SamplingParams\.(\w+)", str(e))
    if m is None:
        return APIError(400, str(e))
    # The client never heard of SamplingParams: "top_p=5.0 must be in (0, 1]" is for them.
    return APIError(400, str(e).removeprefix("SamplingParams."), param=m.group(1))


class EngineDeadError(APIError):
    def __init__(self, why: str) -> None:
        super().__init__(503, f"the engine is not running: {why}", code="engine_dead")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """pydantic's first complaint as one line, and the parameter it is about."""
    err = exc.errors()[0]
    if err.get("type") == "json_invalid":
        return f"malformed JSON body: {err.get('ctx', {}).get('error', 'cannot parse')}", None
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    # For a union, pydantic names the member that failed too ("prompt.str"): still readable.
    # A check of ours raised ValueError: its message is for the client as it stands.
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    return f"{'.'.join(loc) or 'body'}: {msg}", loc[0] if loc else None


def _sent_json(request: Request) -> bool:
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    return media_type == "application/json" or media_type.endswith("+json")


def install_error_handlers(app: FastAPI) -> None:
    app.state.error_shapes = {}

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        log.info("%s %s -> %d: %s", request.method, request.url.path, exc.status, exc.message)
        return error_response(request.app, request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI answers 422; OpenAI (and its clients) expect 400 for a bad body.
        if not _sent_json(request):  # FastAPI did not parse it: say why, not what pydantic saw
            got = request.headers.get("content-type") or "none"
            message = f"send the body as JSON with Content-Type: application/json (got {got})"
            return await api_error(request, APIError(400, message))
        message, param = _validation_message(exc)
        return await api_error(request, APIError(400, message, param=param))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        code = "request_too_large" if exc.status_code == 413 else None
        err = APIError(exc.status_code, str(exc.detail), code=code)
        response = await api_error(request, err)
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        err = APIError(500, f"internal server error: {type(exc).__name__}")
        return error_response(request.app, request.url.path, err)


class BodyLimitMiddleware:
    """413 for a body over `limit` bytes: at once when Content-Length says so, else as soon as
    reading it passes the limit (a chunked upload does not say its length up front)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        message = f"the request body is over the limit of {self.limit} bytes"
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.limit:
            err = APIError(413, message, code="request_too_large")
            log.info("%s %s -> 413: %s", scope["method"], scope["path"], message)
            # scope["app"]: the FastAPI app this middleware wraps (Starlette sets it first)
            response = error_response(scope["app"], scope["path"], err)
            return await response(scope, receive, send)
        seen = 0

        async def receive_counted() -> Message:
            nonlocal seen
            event = await receive()
            seen += len(event.get("body", b""))
            if seen > self.limit:  # raised inside the handler: the 413 handler answers
                raise HTTPException(413, message)
            return event

        await self.app(scope, receive_counted, send)
