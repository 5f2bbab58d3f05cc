"""HTTP side of a service: a FastAPI app served by uvicorn inside the service's asyncio loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from relayrl.config.endpoints import HttpConfig

log = logging.getLogger(__name__)


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
        self._server = _server_class()(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_config=None,
                                                      access_log=False, lifespan="off"))
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
