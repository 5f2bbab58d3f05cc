"""HTTP side of a service: a FastAPI app served by uvicorn inside the service's asyncio loop."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import re
from collections.abc import Awaitable, Callable, Iterator, MutableMapping, Sequence
from typing import Any

from relayrl.config.endpoints import HttpConfig

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` gets 413 (in OpenAI's error shape) before the app sees
    it: at once from ``Content-Length``, or as soon as a chunked body passes the limit. The body is read here, up
    to the limit (memory bounded by it), and replayed to the app."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._refuse(send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: the disconnect message

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send) -> None:
        body = json.dumps(
            {
                "error": {
                    "message": f"request body is larger than {self.max_bytes} bytes",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "body_too_large",
                }
            }
        )
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"connection", b"close")],
            }
        )
        await send({"type": "http.response.body", "body": body.encode()})


WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")
_HOST_PORT = re.compile(r"(?:\[(?P<v6>[^\]]+)\]|(?P<name>[^:\[\]]+))(?::[0-9]{1,5})?")


def host_allowed(header: str | None, allowed: Sequence[str], bind_host: str = "") -> bool:
    """Whether a request's ``Host`` header (name or IP, optional port) names this server: an IP address (a DNS
    rebinding attack's page always sends its own name), ``bind_host`` unless a wildcard, or a name of ``allowed``
    (``*.domain``: its subdomains; ``*``: anything). No Host header, or a malformed one, is refused."""
    if "*" in allowed:
        return True
    match = _HOST_PORT.fullmatch(header.strip()) if header else None
    if match is None:
        return False
    name = (match["v6"] or match["name"]).lower().rstrip(".")
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        if match["v6"]:
            return False
    names = {n.lower().rstrip(".") for n in allowed}
    if bind_host not in WILDCARD_HOSTS:
        names.add(bind_host.strip("[]").lower().rstrip("."))
    return name in names or any(n.startswith("*.") and name.endswith(n[1:]) for n in names)


class TrustedHosts:
    """ASGI middleware: a request whose ``Host`` header :func:`host_allowed` refuses gets 400 (in OpenAI's error
    shape) before any route, or the body limit, sees it."""

    def __init__(self, app: ASGIApp, allowed: Sequence[str], bind_host: str) -> None:
        self.app = app
        self.allowed = tuple(allowed)
        self.bind_host = bind_host
        self.refused = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            host = dict(scope.get("headers") or []).get(b"host")
            if not host_allowed(host.decode("latin-1") if host is not None else None, self.allowed, self.bind_host):
                self.refused += 1
                (log.warning if self.refused == 1 else log.debug)(  # once: a page may send many
                    "refused a request naming a host not in http.allowed_hosts %s (%d so far)",
                    list(self.allowed),
                    self.refused,
                )
                await _refuse_host(scope, send)
                return
        await self.app(scope, receive, send)


async def _refuse_host(scope: Scope, send: Send) -> None:
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return
    body = json.dumps(
        {
            "error": {
                "message": "invalid Host header: this server does not answer that name (http.allowed_hosts)",
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_host",
            }
        }
    )
    await send(
        {
            "type": "http.response.start",
            "status": 400,
            "headers": [(b"content-type", b"application/json"), (b"connection", b"close")],
        }
    )
    await send({"type": "http.response.body", "body": body.encode()})


def _server_class() -> Any:
    import uvicorn

    class _Server(uvicorn.Server):
        """uvicorn without its own signal handlers: the service's loop owns SIGTERM/SIGINT and stops us."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return _Server


class HttpServer:
    """uvicorn on the running loop; ``start`` returns once the socket is bound, ``port`` is the bound port."""

    def __init__(self, app: Any, cfg: HttpConfig, name: str) -> None:
        import uvicorn

        self.cfg = cfg
        self.name = name
        limited = TrustedHosts(BodyLimit(app, cfg.max_body_mib * 1024 * 1024), cfg.allowed_hosts, cfg.host)
        self._server = _server_class()(
            uvicorn.Config(limited, host=cfg.host, port=cfg.port, log_config=None, access_log=False, lifespan="off")
        )
        self._task: asyncio.Task[None] | None = None
        self.port = 0

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(), name=f"http-{self.name}")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the bind error
                raise RuntimeError(f"{self.name} HTTP server exited during start-up")
            await asyncio.sleep(0.01)
        self.port = int(self._server.servers[0].sockets[0].getsockname()[1])
        log.info("%s HTTP API on %s:%d", self.name, self.cfg.host, self.port)

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(self._task, timeout=5)
        self._task = None


def refuse_invalid_bodies(app: Any) -> None:
    """Answer a request that does not match its model with 422 naming where and why, never echoing the input:
    it may hold a secret, or a value JSON cannot carry back (Python's parser accepts ``Infinity``, which FastAPI's
    default handler then fails to render: a 500)."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    async def invalid(_: Any, exc: Exception) -> JSONResponse:
        errors = exc.errors() if isinstance(exc, RequestValidationError) else []
        detail = [
            {"loc": [str(p) for p in e.get("loc", ())], "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
            for e in errors
        ]
        return JSONResponse({"detail": detail}, status_code=422)

    app.add_exception_handler(RequestValidationError, invalid)
