"""The chat page: a browser's `GET /` (an Accept header asking for text/html) gets ui/index.html,
and /ui/* its script and style; an API client's `GET /` still reaches Ollama's answer. Served
ahead of the routes, so the page loads without the API key (it asks for the key itself)."""

from pathlib import Path

from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException
from starlette.responses import PlainTextResponse
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

UI_DIR = Path(__file__).parent / "ui"
# Only the page's own files run and load: no inline script, nothing from another origin.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def _file_path(scope: Scope) -> str | None:
    """The file under UI_DIR a request asks for, or None where it is not the page's."""
    if scope["type"] != "http" or scope["method"] not in ("GET", "HEAD"):
        return None
    path = scope["path"]
    if path == "/":
        return "/index.html" if "text/html" in Headers(scope=scope).get("accept", "") else None
    return path.removeprefix("/ui") if path.startswith("/ui/") else None


class ChatPage:
    """ASGI middleware serving the page's files (with the CSP header); all else goes on."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.files = StaticFiles(directory=UI_DIR)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = _file_path(scope)
        if path is None:
            return await self.app(scope, receive, send)

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers["content-security-policy"] = CSP
                headers["x-content-type-options"] = "nosniff"
                headers["cache-control"] = "no-cache"  # a new version shows after an upgrade
                headers["vary"] = "accept"  # GET / is the page or Ollama's answer
            await send(message)

        try:
            await self.files(scope | {"path": path, "root_path": ""}, receive, send_with_headers)
        except HTTPException as e:  # no such file: raised before anything was sent
            await PlainTextResponse(e.detail, e.status_code)(scope, receive, send_with_headers)
