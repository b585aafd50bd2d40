"""Request size limits, before any route runs: header fields over `PNMIX_MAX_HEADER_BYTES` are
refused with 431, bodies over `PNMIX_MAX_BODY_BYTES` with 413.

Pure ASGI middleware, so the body is seen as it streams in: a declared `Content-Length` over the
limit is refused before a byte is read; a chunked body is counted and refused once it passes the
limit (the route never sees it, the database is never touched). Campaign requests are a few
hundred bytes, so the default of 64 KiB leaves ample room; the header default of 16 KiB is what
common proxies and servers allow.
"""

from __future__ import annotations

from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pnmix.api.problems import PROBLEM_JSON


class HeaderSizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = sum(len(name) + len(value) for name, value in scope["headers"])
            if size > self.max_bytes:
                detail = f"request header fields hold {size} bytes, over {self.max_bytes} (PNMIX_MAX_HEADER_BYTES)"
                await refuse(scope, send, 431, "Request Header Fields Too Large", detail)
                return
        await self.app(scope, receive, send)


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _detail(self) -> str:
        return f"request body over {self.max_bytes} bytes (PNMIX_MAX_BODY_BYTES)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await refuse(scope, send, 413, "Content Too Large", self._detail())
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # Rendered as a problem by the app's handler; FastAPI re-raises HTTPExceptions from body reads.
                    raise HTTPException(413, self._detail())
            return message

        await self.app(scope, counted, send)


async def refuse(scope: Scope, send: Send, status: int, title: str, detail: str) -> None:
    """A problem+json answer sent from the middleware, the connection closed after it."""
    import json

    body: dict[str, Any] = {"type": "about:blank", "title": title, "status": status, "detail": detail,
                            "instance": scope.get("path", "")}
    payload = json.dumps(body).encode()
    headers = [(b"content-type", PROBLEM_JSON.encode()), (b"content-length", str(len(payload)).encode()),
               (b"connection", b"close")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
