"""Every exchange call is owned: its waiter ends it when it stops waiting (rpc/client.py ``CallOwner``), and a
channel that leaves the pool is closed once no call uses it (rpc/transport.py)."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest
import torch

from noloco_node.rpc.client import CallOwner, ExchangeError, Outgoing, exchange_with
from noloco_node.rpc.contracts import EXCHANGE_METHOD
from noloco_node.rpc.transport import Transport
from noloco_node.wire.frames import TensorLayout, build_manifest


def test_a_cancelled_owner_ends_a_call_that_the_peer_never_answers() -> None:
    """A peer that takes the call and then says nothing (a process stopped mid-stream): the waiter gives up after
    0.5 s and the exchange thread is free at once, not at the call's 60 s deadline."""
    release = threading.Event()

    def silent(requests, context):
        release.wait(60)
        return iter(())

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handler = grpc.method_handlers_generic_handler(
        "noloco.v1.Peer", {"Exchange": grpc.stream_stream_rpc_method_handler(silent)}
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    assert EXCHANGE_METHOD == "/noloco.v1.Peer/Exchange"
    try:
        named = [("w", torch.zeros(4))]
        outgoing = Outgoing(
            build_manifest(named, wire_dtype="fp32", run_fingerprint="run", peer_id="me", outer_step=1), [named[0][1]]
        )
        owner = CallOwner()
        ended: list[BaseException] = []

        def call() -> None:
            try:
                exchange_with(
                    f"127.0.0.1:{port}",
                    outgoing,
                    [TensorLayout("w", (4,))],
                    run_fingerprint="run",
                    max_payload_bytes=1 << 20,
                    timeout=60,
                    owner=owner,
                )
            except BaseException as error:
                ended.append(error)

        thread = threading.Thread(target=call)
        thread.start()
        time.sleep(0.5)  # the waiter's patience, not a synchronisation: the call blocks however long it waits
        cancelled_at = time.monotonic()
        owner.cancel()
        thread.join(5)
        assert not thread.is_alive() and time.monotonic() - cancelled_at < 2
        assert isinstance(ended[0], ExchangeError) and ended[0].code == grpc.StatusCode.CANCELLED, ended
        # An owner cancelled before its call starts ends the call as it starts.
        early = CallOwner()
        early.cancel()
        owner, ended[:] = early, []
        started = time.monotonic()
        call()
        assert time.monotonic() - started < 2 and isinstance(ended[0], ExchangeError), ended
    finally:
        release.set()
        server.stop(0)


class Recorded(Transport):
    """A transport whose channels say when they are closed."""

    def __init__(self) -> None:
        super().__init__()
        self.closed: list[str] = []

    def new_channel(self, address: str) -> grpc.Channel:
        channel = super().new_channel(address)
        close = channel.close

        def recorded_close() -> None:
            self.closed.append(address)
            close()

        channel.close = recorded_close  # type: ignore[method-assign]
        return channel


def test_a_channel_that_leaves_the_pool_closes_once_no_call_uses_it() -> None:
    transport = Recorded()
    transport.POOL_SIZE = 2
    with transport.channel("127.0.0.1:1"):
        transport.forget("127.0.0.1:1")  # dropped while a call uses it: it stays open for that call
        assert transport.closed == []
    assert transport.closed == ["127.0.0.1:1"]  # the last call out closed it
    for port in (2, 3, 4):  # the least recently used is evicted and, unused, closed at once
        with transport.channel(f"127.0.0.1:{port}"):
            pass
    assert transport.closed == ["127.0.0.1:1", "127.0.0.1:2"]
    # A call that failed on its connection drops the channel; a refusal the peer answered keeps it.
    with pytest.raises(ValueError), transport.channel("127.0.0.1:3"):
        raise ValueError("a broken connection")
    assert transport.closed[-1] == "127.0.0.1:3"
    # Stopping closes every channel, the pooled ones and one a call still uses after it left the pool.
    with transport.channel("127.0.0.1:5"):
        transport.forget("127.0.0.1:5")
        transport.close_channels()
        assert sorted(transport.closed) == [f"127.0.0.1:{port}" for port in range(1, 6)]
    assert len(transport.closed) == 5  # closed once
