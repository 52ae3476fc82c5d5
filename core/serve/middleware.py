"""Pure ASGI middlewares (no BaseHTTPMiddleware: it would wrap `receive` and hide client disconnects).

Outermost first, as `app.py` stacks them: count responses by status -> API key -> refuse while draining ->
body size limit -> the FastAPI app.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deepinfer.serve.errors import (
    APIError,
    AuthenticationError,
    BadRequestError,
    PayloadTooLargeError,
    ServerDrainingError,
)
from deepinfer.serve.metrics import ServerMetrics
from deepinfer.serve.sse import CLIENT_CLOSED_REQUEST

PROTECTED_PREFIX = "/v1"  # /health and /metrics stay open, for load balancers and scrapers


async def _reply(error: APIError, scope: Scope, receive: Receive, send: Send, close: bool = False) -> None:
    response = error.response()
    if close:
        response.headers["Connection"] = "close"
    await response(scope, receive, send)


class RequestCountMiddleware:
    """Counts every HTTP response by endpoint and status code (deepinfer_http_requests_total)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status: list[int] = []

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.metrics.count_response(scope.get("path", ""), status[0] if status else CLIENT_CLOSED_REQUEST)


class APIKeyMiddleware:
    """`Authorization: Bearer <key>` on /v1 routes. Both sides are hashed to fixed-length digests and compared
    with hmac.compare_digest, so the comparison's time reveals neither the key nor its length."""

    def __init__(self, app: ASGIApp, api_key: str | None):
        self.app = app
        self._digest = None if api_key is None else hashlib.sha256(api_key.encode()).digest()

    def _authorized(self, scope: Scope) -> bool:
        header = Headers(scope=scope).get("authorization", "")
        scheme, _, token = header.partition(" ")
        presented = token.strip() if scheme.lower() == "bearer" else ""
        candidate = hashlib.sha256(presented.encode("utf-8", "surrogateescape")).digest()
        # Always compare (also for a missing header), so every refusal takes the same path.
        return hmac.compare_digest(candidate, self._digest) and bool(presented)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (self._digest is not None and scope["type"] == "http" and scope.get("path", "").startswith(PROTECTED_PREFIX)
                and not self._authorized(scope)):
            error = AuthenticationError("Incorrect or missing API key: send it as 'Authorization: Bearer <key>'",
                                        headers={"WWW-Authenticate": "Bearer"})
            return await _reply(error, scope, receive, send)
        await self.app(scope, receive, send)


class DrainMiddleware:
    """While draining (SIGTERM), new /v1 requests get 503 + Retry-After and the connection is closed."""

    def __init__(self, app: ASGIApp, draining: Callable[[], bool]):
        self.app, self.draining = app, draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path", "").startswith(PROTECTED_PREFIX) and self.draining():
            error = ServerDrainingError("the server is shutting down and accepts no new requests")
            return await _reply(error, scope, receive, send, close=True)
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for bodies over `limit` bytes: at once when Content-Length says so, else as soon as the chunked body
    passes the limit. The body is read here and replayed to the app; later `receive` calls (disconnect
    detection) go straight to the server."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        too_large = PayloadTooLargeError(f"the request body exceeds the server's limit of {self.limit} bytes")
        length = Headers(scope=scope).get("content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                declared = -1
            if declared < 0:
                return await _reply(BadRequestError("invalid Content-Length header"), scope, receive, send, close=True)
            if declared > self.limit:
                return await _reply(too_large, scope, receive, send, close=True)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # gone before sending the whole body: nothing to answer
            if message["type"] != "http.request":
                continue
            body = message.get("body", b"")
            size += len(body)
            if size > self.limit:
                return await _reply(too_large, scope, receive, send, close=True)
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
