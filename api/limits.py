"""Request body size limit: bodies over `PNMIX_MAX_BODY_BYTES` are refused with 413 before any route runs.

A pure ASGI middleware, so it sees the body as it streams in: a declared `Content-Length` over the
limit is refused before a byte is read; a chunked body is counted and refused once it passes the
limit (the route never sees it, the database is never touched). Campaign requests are a few
hundred bytes, so the default of 64 KiB leaves ample room.
"""

from __future__ import annotations

from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.problems import PROBLEM_JSON


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
            await self._refuse(scope, send)
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

    async def _refuse(self, scope: Scope, send: Send) -> None:
        import json

        body: dict[str, Any] = {"type": "about:blank", "title": "Content Too Large", "status": 413,
                                "detail": self._detail(), "instance": scope.get("path", "")}
        payload = json.dumps(body).encode()
        headers = [(b"content-type", PROBLEM_JSON.encode()), (b"content-length", str(len(payload)).encode()),
                   (b"connection", b"close")]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": payload})
