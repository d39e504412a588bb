"""Discovery over a real Hivemind DHT on loopback, joined through a real `noloco-node bootstrap` process."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator

import pytest
from hivemind.utils.timed_storage import get_dht_time

from noloco_node.discovery import Discovery, PeerRecord, peers_key, start_bootstrap_process


@pytest.fixture(scope="module")
def bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """A real `noloco-node bootstrap` process; SIGTERM must stop it cleanly."""
    process, maddrs = start_bootstrap_process(tmp_path_factory.mktemp("bootstrap") / "bootstrap.log")
    assert all(m.startswith("/ip4/127.0.0.1/") for m in maddrs)
    yield maddrs
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0


def started(run: str, maddrs: list[str], ttl: float = 30.0) -> Discovery:
    discovery = Discovery(run, initial_peers=maddrs, record_ttl=ttl, dht_timeout=10)
    discovery.start()
    return discovery


async def wait_for(condition, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = await condition()
        if result:
            return result
        await asyncio.sleep(0.2)
    raise AssertionError("condition not met in time")


def test_peers_of_a_run_find_each_other_and_nobody_else(bootstrap: list[str]) -> None:
    a, b, other = started("run-a", bootstrap), started("run-a", bootstrap), started("run-b", bootstrap)
    try:

        async def scenario() -> None:
            record_a = PeerRecord(a.peer_id, "127.0.0.1:5001", "run-a", outer_step=3, ready=True)
            record_b = PeerRecord(b.peer_id, "127.0.0.1:5002", "run-a", outer_step=4)
            assert await a.publish(record_a) and await b.publish(record_b)
            assert await other.publish(PeerRecord(other.peer_id, "127.0.0.1:5003", "run-b"))

            async def a_sees_b():
                return [r for r in await a.live_peers() if r.peer_id == b.peer_id]

            seen = (await wait_for(a_sees_b))[0]
            assert (seen.address, seen.outer_step, seen.ready) == ("127.0.0.1:5002", 4, False)
            assert {r.peer_id for r in await b.live_peers()} == {a.peer_id}
            assert [r.peer_id for r in await other.live_peers()] == []  # another run's records are invisible

            # A stranger's malformed record under the run's key is skipped, not trusted.
            garbage = other.dht.store(
                peers_key("run-a"),
                {"address": "not-an-address"},
                get_dht_time() + 30,
                subkey="forged",
                return_future=True,
            )
            await asyncio.wrap_future(garbage)
            assert {r.peer_id for r in await a.live_peers(include_self=True)} == {a.peer_id, b.peer_id}

            # A leaving node's tombstone hides it at once.
            assert await b.withdraw(record_b)
            assert await wait_for(lambda: _not_seen(a, b.peer_id), timeout=10)

        asyncio.run(scenario())
    finally:
        for d in (a, b, other):
            d.shutdown()


async def _not_seen(observer: Discovery, peer_id: str) -> bool:
    return all(r.peer_id != peer_id for r in await observer.live_peers())


def test_a_record_that_is_not_refreshed_expires(bootstrap: list[str]) -> None:
    a, b = started("run-c", bootstrap, ttl=2.0), started("run-c", bootstrap)
    try:

        async def scenario() -> None:
            assert await a.publish(PeerRecord(a.peer_id, "127.0.0.1:6001", "run-c"))

            async def b_sees_a():
                return any(r.peer_id == a.peer_id for r in await b.live_peers())

            await wait_for(b_sees_a)
            await asyncio.sleep(2.5)
            assert not await b_sees_a()

        asyncio.run(scenario())
    finally:
        a.shutdown()
        b.shutdown()
