"""The project's one HTTP server: a node's status endpoint (and a bootstrap peer's /maddrs), on an event loop.

Routes are plain callables that return (content type, body) from numbers the node already holds, so answering
costs the trainer nothing (no torch, no locks held for long). ``/healthz`` answers 200 or 503 with the health
reason. Each connection serves one request under a deadline, with the request head capped in size, so a slow or
hostile client cannot hold the loop or its memory. GET and HEAD only: the endpoint changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from importlib import resources

from prometheus_client import CollectorRegistry

from noloco_node.observability.metrics import register_status, render_metrics
from noloco_node.observability.rl_status import RolloutNodeStatus
from noloco_node.observability.status import Health, NodeStatus

log = logging.getLogger(__name__)

MAX_REQUEST_HEAD = 16 * 1024
REQUEST_DEADLINE = 5.0

Route = Callable[[], tuple[str, bytes]]
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 500: "Internal Server Error"}
_REASONS[503] = "Service Unavailable"


def status_page(name: str = "status.html") -> bytes:
    """A live page, served as one self-contained HTML file (inline script and style, no CDN, no build step): its
    ``/* style.css */`` is replaced by the style both pages share. rl.html is the RL node's."""
    web = resources.files("noloco_node.observability").joinpath("web")
    page = web.joinpath(name).read_text()
    return page.replace("/* style.css */", web.joinpath("style.css").read_text(), 1).encode()


def node_routes(status: Callable[[], NodeStatus], registry: CollectorRegistry) -> dict[str, Route]:
    """A node's pages: its status as JSON, its registry for Prometheus (status gauges included), the live page."""
    register_status(registry, status)
    return {
        "/status": lambda: ("application/json", status().model_dump_json().encode()),
        "/metrics": lambda: ("text/plain; version=0.0.4; charset=utf-8", render_metrics(registry)),
        "/": lambda: ("text/html; charset=utf-8", status_page()),
    }


def rl_routes(status: Callable[[], RolloutNodeStatus], registry: CollectorRegistry) -> dict[str, Route]:
    """An RL node's pages (noloco_node/rl/): its status as JSON, its registry for Prometheus, its live page."""
    return {
        "/status": lambda: ("application/json", status().model_dump_json().encode()),
        "/metrics": lambda: ("text/plain; version=0.0.4; charset=utf-8", render_metrics(registry)),
        "/": lambda: ("text/html; charset=utf-8", status_page("rl.html")),
    }


class StatusServer:
    def __init__(self, routes: dict[str, Route], *, healthz: Callable[[], Health]) -> None:
        self.routes = routes
        self.healthz = healthz
        self._server: asyncio.Server | None = None
        self.requests = 0

    async def start(self, host: str, port: int) -> int:
        """Listen; returns the bound port (ephemeral when ``port`` is 0)."""
        self._server = await asyncio.start_server(self._serve, host, port, limit=MAX_REQUEST_HEAD)
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), timeout=2.0)
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=REQUEST_DEADLINE)
            except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                return  # too slow, too large or gone: drop it without an answer
            status, content_type, body, method = self._answer(head)
            self.requests += 1
            writer.write(
                (
                    f"HTTP/1.1 {status} {_REASONS[status]}\r\n"
                    f"Content-Type: {content_type}\r\n"
                    f"Content-Length: {len(body)}\r\n"
                    "Cache-Control: no-store\r\n"
                    "Connection: close\r\n\r\n"
                ).encode()
                + (b"" if method == "HEAD" else body)
            )
            with contextlib.suppress(asyncio.TimeoutError, ConnectionError):
                await asyncio.wait_for(writer.drain(), timeout=REQUEST_DEADLINE)
        finally:
            writer.close()

    def _answer(self, head: bytes) -> tuple[int, str, bytes, str]:
        text = "text/plain; charset=utf-8"
        try:
            method, target, version = head.split(b"\r\n", 1)[0].decode("ascii").split(" ")
        except ValueError:
            return 400, text, b"malformed request line\n", "GET"
        if not version.startswith("HTTP/1."):
            return 400, text, b"HTTP/1.x only\n", "GET"
        if method not in ("GET", "HEAD"):
            return 405, text, b"GET or HEAD only\n", method
        path = target.split("?", 1)[0]
        if path == "/healthz":
            health = self.healthz()
            return (200 if health.ok else 503), text, f"{health}\n".encode(), method
        route = self.routes.get(path)
        if route is None:
            return 404, text, f"no such page: {path} (try /, /status, /metrics, /healthz)\n".encode(), method
        try:
            content_type, body = route()
        except Exception:  # a bug in one page must not take the endpoint down
            log.exception("status endpoint: %s failed", path)
            return 500, text, b"internal error (see the node's log)\n", method
        return 200, content_type, body, method
