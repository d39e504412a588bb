"""observability/http_server.py over real sockets: routes, status codes, HEAD, and slow or oversized clients."""

from __future__ import annotations

import asyncio
import socket

import pytest

from noloco_node.observability import http_server as status_server
from noloco_node.observability.http_server import StatusServer, status_page
from noloco_node.observability.status import Health


async def request(port: int, raw: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), timeout=5)
    writer.close()
    return answer


def serve(health: Health, routes: dict | None = None) -> tuple[StatusServer, int, asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()

    def broken() -> tuple[str, bytes]:
        raise ValueError("a bug")

    server = StatusServer(
        routes or {"/status": lambda: ("application/json", b'{"ok": 1}'), "/broken": broken}, healthz=lambda: health
    )
    port = loop.run_until_complete(server.start("127.0.0.1", 0))
    return server, port, loop


def test_routes_codes_and_head() -> None:
    server, port, loop = serve(Health(state="training", reason="", ok=True))
    try:
        ask = lambda raw: loop.run_until_complete(request(port, raw))  # noqa: E731
        ok = ask(b"GET /status?x=1 HTTP/1.1\r\nHost: x\r\n\r\n")
        assert ok.startswith(b"HTTP/1.1 200 OK") and ok.endswith(b'{"ok": 1}') and b"Content-Length: 9" in ok
        head = ask(b"HEAD /status HTTP/1.1\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and head.endswith(b"\r\n\r\n")  # headers only
        assert ask(b"GET /healthz HTTP/1.1\r\n\r\n").endswith(b"training\n")
        assert ask(b"GET /nope HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 404")
        assert ask(b"POST /status HTTP/1.1\r\nContent-Length: 0\r\n\r\n").startswith(b"HTTP/1.1 405")
        assert ask(b"garbage\r\n\r\n").startswith(b"HTTP/1.1 400")
        assert ask(b"GET /broken HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 500")
        assert server.requests == 7
    finally:
        loop.run_until_complete(server.close())
        loop.close()


def test_unhealthy_is_503_with_the_reason() -> None:
    server, port, loop = serve(Health(state="failed", reason="trainer thread died: boom", ok=False))
    try:
        answer = loop.run_until_complete(request(port, b"GET /healthz HTTP/1.1\r\n\r\n"))
        assert answer.startswith(b"HTTP/1.1 503 Service Unavailable") and answer.endswith(
            b"failed: trainer thread died: boom\n"
        )
    finally:
        loop.run_until_complete(server.close())
        loop.close()


def test_slow_and_oversized_clients_are_dropped_and_others_still_served(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(status_server, "REQUEST_DEADLINE", 0.5)
    server, port, loop = serve(Health(state="training", reason="", ok=True))
    try:

        async def scenario() -> tuple[bytes, bytes, bytes]:
            loris = socket.create_connection(("127.0.0.1", port))
            loris.sendall(b"GET /status HTTP/1.1\r\n")  # and never finishes its head
            served = await request(port, b"GET /status HTTP/1.1\r\n\r\n")  # others are not held up
            huge = await request(port, b"GET /" + b"a" * (status_server.MAX_REQUEST_HEAD + 10) + b" HTTP/1.1\r\n\r\n")
            await asyncio.sleep(0.8)
            loris.settimeout(2)
            dropped = loris.recv(100)
            loris.close()
            return served, huge, dropped

        served, huge, dropped = loop.run_until_complete(scenario())
        assert served.startswith(b"HTTP/1.1 200") and huge == b"" and dropped == b""
    finally:
        loop.run_until_complete(server.close())
        loop.close()


def test_the_page_is_self_contained() -> None:
    page = status_page().decode()
    assert page.startswith("<!doctype html>") and "<canvas" in page and 'fetch("status"' in page
    assert "src=" not in page and "https://" not in page  # no external script, font or style
