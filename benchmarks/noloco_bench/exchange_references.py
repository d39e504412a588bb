"""The references `bench exchange` measures beside the node's exchange, on the same path in the same run: raw TCP
between two plain processes (one way, and both ways at once) and bare gRPC moving the same bytes with no work."""

from __future__ import annotations

import multiprocessing as mp
import socket
import threading
import time
from concurrent import futures
from typing import Any

import grpc

TCP_BUFFER = 4 * 2**20
# (namespace, host) of the server and of the client: None for this machine's own network.
Where = tuple[tuple[str | None, str], tuple[str | None, str]]


def enter(namespace: str | None) -> None:
    if namespace:
        from noloco_bench.netns import enter_namespace

        enter_namespace(namespace)


def _tcp_receiver(total: int, listener_port: Any, both_ways: bool, conn: Any, namespace: str | None, host: str) -> None:
    enter(namespace)
    listener = socket.socket()
    listener.bind((host, 0))
    listener.listen(1)
    listener_port.send(listener.getsockname()[1])
    peer, _ = listener.accept()
    _transfer(peer, total, both_ways, send=both_ways)
    conn.send("done")


def _transfer(sock: socket.socket, total: int, both_ways: bool, *, send: bool) -> None:
    """Receive ``total`` bytes (and, both ways, send as many at the same time from a thread)."""
    import threading

    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, TCP_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, TCP_BUFFER)
    data = memoryview(bytearray(min(total, 64 * 2**20)))

    def sender() -> None:
        sent = 0
        while sent < total:
            n = min(len(data), total - sent)
            sock.sendall(data[:n])
            sent += n

    thread = threading.Thread(target=sender) if send else None
    if thread:
        thread.start()
    if both_ways or not send:
        buffer = memoryview(bytearray(min(total, 64 * 2**20)))
        received = 0
        while received < total:
            n = sock.recv_into(buffer, min(len(buffer), total - received))
            if n == 0:
                raise ConnectionError("peer closed early")
            received += n
    if thread:
        thread.join()


def _tcp_sender(
    total: int, address: tuple[str, int], both_ways: bool, done: Any, conn: Any, namespace: str | None
) -> None:
    enter(namespace)
    sock = socket.create_connection(address)
    started = time.perf_counter()
    _transfer(sock, total, both_ways, send=True)
    done.recv()
    conn.send(time.perf_counter() - started)
    sock.close()


def raw_tcp_seconds(
    total: int, *, both_ways: bool, where: tuple[tuple[str | None, str], tuple[str | None, str]]
) -> float:
    """Two plain processes moving ``total`` bytes (one way, or both ways at once) over the same path."""
    (server_ns, server_host), (client_ns, _client_host) = where
    ctx = mp.get_context("spawn")
    port_rx, port_tx = ctx.Pipe(duplex=False)
    done_rx, done_tx = ctx.Pipe(duplex=False)
    result_rx, result_tx = ctx.Pipe(duplex=False)
    receiver = ctx.Process(target=_tcp_receiver, args=(total, port_tx, both_ways, done_tx, server_ns, server_host))
    receiver.start()
    port = port_rx.recv()
    sender = ctx.Process(
        target=_tcp_sender, args=(total, (server_host, port), both_ways, done_rx, result_tx, client_ns)
    )
    sender.start()
    elapsed = result_rx.recv()
    sender.join()
    receiver.join()
    return elapsed


def _bare_grpc_server(chunks: int, chunk_bytes: int, conn: Any, namespace: str | None, host: str) -> None:
    """gRPC alone: a bidirectional stream of ready-made byte messages, nothing converted, checked or copied."""
    from noloco_node.rpc.transport import CHANNEL_OPTIONS  # here: the raw TCP processes need none of the node

    enter(namespace)
    blob = b"\0" * chunk_bytes

    def echo(requests: Any, context: Any) -> Any:
        reader = threading.Thread(target=lambda: sum(1 for _ in requests))
        reader.start()
        for _ in range(chunks):
            yield blob
        reader.join()

    handler = grpc.method_handlers_generic_handler("bench.Bare", {"Both": grpc.stream_stream_rpc_method_handler(echo)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=CHANNEL_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    conn.send(server.add_insecure_port(f"{host}:0"))
    server.start()
    conn.recv()
    server.stop(grace=None)


def bare_grpc_seconds(total: int, chunk_bytes: int, repeats: int, where: Where) -> float:
    """The floor any gRPC transport has on this path: ``total`` bytes each way in ``chunk_bytes`` messages."""
    (server_ns, server_host), (client_ns, _) = where
    chunks = -(-total // chunk_bytes)
    ctx = mp.get_context("spawn")
    server_rx, server_tx = ctx.Pipe()
    server = ctx.Process(target=_bare_grpc_server, args=(chunks, chunk_bytes, server_tx, server_ns, server_host))
    server.start()
    port = server_rx.recv()
    result_rx, result_tx = ctx.Pipe(duplex=False)
    client = ctx.Process(
        target=_bare_grpc_client, args=(chunks, chunk_bytes, f"{server_host}:{port}", repeats, result_tx, client_ns)
    )
    client.start()
    seconds = result_rx.recv()
    client.join()
    server_rx.send("stop")
    server.join()
    return seconds


def _bare_grpc_client(
    chunks: int, chunk_bytes: int, address: str, repeats: int, conn: Any, namespace: str | None
) -> None:
    from noloco_node.rpc.transport import CHANNEL_OPTIONS  # here: the raw TCP processes need none of the node

    enter(namespace)
    blob = b"\0" * chunk_bytes
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        both = channel.stream_stream("/bench.Bare/Both")
        seconds = []
        for _ in range(repeats):
            started = time.perf_counter()
            for _ in both(iter([blob] * chunks), timeout=600):
                pass
            seconds.append(time.perf_counter() - started)
    conn.send(min(seconds))
