"""Discovery over a real Hivemind DHT on loopback, joined through a real `noloco-node bootstrap` process."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator

import hivemind
import pytest
from hivemind.utils.timed_storage import get_dht_time

from noloco_node.discovery.buckets import Bucket
from noloco_node.discovery.dht import Discovery, PeerRecord
from noloco_node.node.bootstrap import start_bootstrap_process
from noloco_node.security.auth import SwarmSecret, record_mac
from noloco_node.security.identity import NodeIdentity


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
                Bucket(0, 0).key("run-a"),
                {"address": "not-an-address"},
                get_dht_time() + 30,
                subkey="forged",
                return_future=True,
            )
            await asyncio.wrap_future(garbage)
            assert {r.peer_id for r in await a.live_peers(include_self=True)} == {a.peer_id, b.peer_id}

            # A leaving node's tombstone hides it at once.
            assert await b.withdraw(record_b)
            assert b.stored_within(60.0) is None  # a tombstone is never refreshed as the node's record
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
            record = PeerRecord(a.peer_id, "127.0.0.1:6001", "run-c")
            assert await a.publish(record)
            # What the node's refresh loop reads to skip a store: the record, stored within the last second.
            assert a.stored_within(1.0) == record and b.stored_within(1.0) is None

            async def b_sees_a():
                return any(r.peer_id == a.peer_id for r in await b.live_peers())

            await wait_for(b_sees_a)
            await asyncio.sleep(2.5)
            assert not await b_sees_a()
            assert a.stored_within(2.0) is None  # stored longer ago: the refresh loop stores it again

        asyncio.run(scenario())
    finally:
        a.shutdown()
        b.shutdown()


def test_nobody_can_overwrite_a_peers_record_and_a_private_run_ignores_strangers(bootstrap: list[str]) -> None:
    secret = SwarmSecret(b"a-shared-secret-of-the-run-0123456789", "test")
    a = Discovery("run-p", initial_peers=bootstrap, secret=secret, identity=NodeIdentity.ephemeral())
    b = Discovery("run-p", initial_peers=bootstrap, secret=secret)
    stranger = Discovery("run-p", initial_peers=bootstrap)  # no secret
    thief = Discovery("run-p", initial_peers=bootstrap, secret=secret)  # a member, with its own key
    for d in (a, b, stranger, thief):
        d.start()
    try:

        async def scenario() -> None:
            record_a = PeerRecord(a.peer_id, "127.0.0.1:7001", "run-p", outer_step=5, ready=True)
            assert await a.publish(record_a)

            async def b_sees_a():
                return [r for r in await b.live_peers() if r.peer_id == a.peer_id]

            assert (await wait_for(b_sees_a))[0].address == "127.0.0.1:7001"
            # The stranger's own record carries no MAC under the run's secret: members never list it.
            assert await stranger.publish(PeerRecord(stranger.peer_id, "127.0.0.1:7002", "run-p", ready=True))
            assert {r.peer_id for r in await stranger.live_peers(include_self=True)} >= {stranger.peer_id}
            # Writes under a's subkey (its public key) by anyone else, member or not, are refused by the DHT.
            for forger in (stranger, thief):
                value = {**PeerRecord("x", "10.6.6.6:6666", "run-p", outer_step=99, ready=True).to_value()}
                value["mac"] = record_mac(secret, a.key, a.subkey, value)  # even a valid MAC does not help
                stored = forger.dht.store(a.key, value, get_dht_time() + 30, subkey=a.subkey, return_future=True)
                assert not await asyncio.wrap_future(stored)
            # A modified peer that runs no validator stores the forgery itself and pushes it to others: they refuse
            # it, and what it answers to lookups fails their validation, so readers still see a's own record.
            rogue = hivemind.DHT(initial_peers=bootstrap, start=True)
            try:
                value = PeerRecord("x", "10.6.6.6:6666", "run-p", outer_step=99, ready=True).to_value()
                value["mac"] = record_mac(secret, a.key, a.subkey, value)
                await asyncio.wrap_future(
                    rogue.store(a.key, value, get_dht_time() + 30, subkey=a.subkey, return_future=True)
                )
                await asyncio.sleep(1.0)
                seen = {r.peer_id: r for r in await b.live_peers()}
            finally:
                rogue.shutdown()
            assert stranger.peer_id not in seen
            assert seen[a.peer_id].address == "127.0.0.1:7001" and seen[a.peer_id].outer_step == 5
            # A peer id is a digest of the key that signs the record: it cannot be claimed by another key.
            assert a.peer_id == a.identity.peer_id != thief.peer_id

        asyncio.run(scenario())
    finally:
        for d in (a, b, stranger, thief):
            d.shutdown()


def test_a_node_probing_for_its_swarm_looks_up_five_times_a_second_and_once_a_second_when_settled(
    bootstrap: list[str],
) -> None:
    """A lookup is shared among a node's callers for a second, but while the node has found nobody it probes a
    level per lookup (buckets.py), and a swarm at level 10 took 10 s to find at one a second: its lookups are
    shared for PROBE_SHARING_SECONDS then. Callers asking every 50 ms, as a joiner's loops together do."""
    from noloco_node.discovery.dht import LOOKUP_SHARING_SECONDS, PROBE_SHARING_SECONDS

    joiner, member = started("run-probe", bootstrap), started("run-probe", bootstrap)
    lookups: list[bool] = []  # whether the joiner was probing at each of its lookups
    real_lookup = joiner._lookup_records

    async def counted() -> list[PeerRecord]:
        lookups.append(joiner.size.probing)
        return await real_lookup()

    joiner._lookup_records = counted  # type: ignore[method-assign]
    try:

        async def asking_for(seconds: float) -> None:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                await joiner.live_peers()
                await asyncio.sleep(0.05)

        async def scenario() -> None:
            await asking_for(2.0)  # alone: probing
            probes = len(lookups)
            assert probes >= 2.0 / PROBE_SHARING_SECONDS * 0.6 and all(lookups), lookups
            assert await member.publish(PeerRecord(member.peer_id, "127.0.0.1:5009", "run-probe"))
            await wait_for(joiner.live_peers)  # found: settled at its level
            assert not joiner.size.probing
            settled_from = len(lookups)
            await asking_for(3.0)
            assert len(lookups) - settled_from <= 3.0 / LOOKUP_SHARING_SECONDS + 1, lookups

        asyncio.run(scenario())
    finally:
        joiner.shutdown()
        member.shutdown()
