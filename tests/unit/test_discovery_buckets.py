"""Records live in hash buckets whose level follows the swarm's size: a node's estimate converges from the buckets it
reads, a joiner finds a swarm at any level, a view keeps what its reads said, and a DHT peer keeps a bounded number
of entries under one key."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from hivemind.dht import storage
from hivemind.dht.routing import DHTID
from hivemind.utils.timed_storage import get_dht_time

from noloco_node.discovery.buckets import ABOVE_EVERY, MAX_LEVEL, Bucket, SwarmSize, peer_hash
from noloco_node.discovery.dht import bound_dictionaries
from noloco_node.discovery.view import RecordView


def test_a_peers_buckets_nest_and_their_keys_name_level_and_bits() -> None:
    peer = "nlpeer-one"
    assert Bucket.of(peer, 0) == Bucket(0, 0) and Bucket(0, 0).key("fp") == "noloco/fp/peers/0/"
    for level in range(1, 12):
        bucket = Bucket.of(peer, level)
        assert bucket.index >> 1 == Bucket.of(peer, level - 1).index  # one bit more each level
        assert bucket.key("fp") == f"noloco/fp/peers/{level}/{format(peer_hash(peer) >> (32 - level), f'0{level}b')}"
        assert bucket.holds(peer) and not Bucket(level, bucket.index ^ 1).holds(peer)


def settled(size: float, bucket_records: int = 32) -> SwarmSize:
    """A node whose reads all said ``size``: its level, and the levels it writes at."""
    node = SwarmSize(bucket_records)
    for _ in range(40):
        level = node.read_level()
        node.observe(Bucket(level, 0), round(size / 2**level), 1)
    return node


def test_a_node_writes_at_its_level_and_the_neighbour_its_estimate_leans_to() -> None:
    assert settled(10).written_levels() == (0,)  # a small swarm: one bucket, one store
    assert settled(40).level == 0 and settled(40).written_levels() == (0, 1)  # log2(40/32) = 0.32: leans up
    big = settled(6000)  # log2(6000/32) = 7.55
    assert big.level in (7, 8) and big.written_levels() == (7, 8)
    assert SwarmSize(32).written_levels() == (0,)  # probing: its level only
    # An estimate right on an odd level (32 x 2^7) leans nowhere, and still writes the even level beside it: the
    # probes read even levels only.
    exact = settled(32 * 2**7)
    assert exact.level == 7 and exact.written_levels() == (6, 7)
    assert settled(32 * 2**6).written_levels() == (6,)


def test_the_probes_cover_every_pair_of_levels_a_writer_may_write() -> None:
    node = SwarmSize(32)
    probes = []
    for _ in range(2 * MAX_LEVEL):
        probes.append(node.read_level())
        node.observe(Bucket(probes[-1], 0), 0, 0)
    assert probes[::2] == [0] * MAX_LEVEL  # a small swarm's level, between any two probes
    for level in range(MAX_LEVEL):
        for written in ({level, level + 1}, {max(0, level - 1), level}):
            assert written & set(probes), (written, probes)


def swarm_read(members: list[str], written: tuple[int, ...], bucket: Bucket) -> int:
    """How many of ``members`` (all writing at the levels ``written``) have a record in ``bucket``."""
    return sum(bucket.holds(peer) for peer in members) if bucket.level in written else 0


@pytest.mark.parametrize("members", [0, 1, 20, 300, 4096, 5000])
def test_a_joiner_finds_the_swarm_at_any_level_and_its_estimate_settles_there(members: int) -> None:
    """Writers settled where a bucket holds ~32 records; a new node probes, finds them, and reads at their level."""
    rng = random.Random(members)
    swarm = [f"peer-{i}" for i in range(members)]
    written = settled(max(members, 1)).written_levels()
    joiner = SwarmSize(32)
    reads = 0
    while joiner.probing and reads < 40:
        bucket = Bucket.random(joiner.read_level(), rng)
        found = swarm_read(swarm, written, bucket)
        joiner.observe(bucket, found, found)
        reads += 1
    if members == 0:  # nobody else anywhere: it keeps probing, level 0 every other read
        assert joiner.probing and joiner.estimate is None
        return
    assert not joiner.probing and reads <= 2 * (max(written) // 2 + 1)
    for _ in range(60):
        bucket = Bucket.random(joiner.read_level(), rng)
        found = swarm_read(swarm, written, bucket)
        joiner.observe(bucket, found, found)
    assert joiner.level in written
    estimate = joiner.estimate
    assert estimate is not None and members / 2 < estimate < members * 2


def test_members_settled_apart_at_a_low_level_find_the_larger_swarm_above_and_move_to_its_level() -> None:
    """Joiners that came up together probe level 0 first and can find each other there before the swarm they joined
    (100 members writing at levels 2-3): settled as a swarm of 18, a joiner reads one bucket in ABOVE_EVERY above its
    level, finds the members' records and moves to their level. A member of the larger swarm reads above it too, finds
    nothing there (or a stray record) and stays."""
    rng = random.Random(4)
    swarm = [f"peer-{i}" for i in range(100)]
    written = settled(100, 16).written_levels()
    apart = [f"joiner-{i}" for i in range(18)]

    def read(node: SwarmSize) -> None:  # one lookup: a bucket at the node's level, and one above now and then
        above = node.above_level()
        for level in (node.read_level(), *([above] if above is not None else [])):
            bucket = Bucket.random(level, rng)
            found = swarm_read(apart, (0,), bucket) + swarm_read(swarm, written, bucket)
            node.observe(bucket, found, found)

    joiner = SwarmSize(16)
    read(joiner)  # the first probe reads level 0: the joiners only
    assert not joiner.probing and joiner.level == 0 and joiner.estimate == 18
    reads = 0
    while joiner.level not in written and reads < ABOVE_EVERY * MAX_LEVEL:
        read(joiner)
        reads += 1
    assert joiner.level in written and reads <= 2 * ABOVE_EVERY, reads  # level 2 is the first read above
    for _ in range(40):
        read(joiner)
    assert joiner.level in written and joiner.estimate is not None and 50 < joiner.estimate < 200
    member = settled(100, 16)
    for _ in range(100):
        above = member.above_level()
        member.observe(Bucket.random(member.read_level(), rng), round(100 / 2**member.level), 1)
        if above is not None:  # a record left above by a level the swarm has left
            member.observe(Bucket.random(above, rng), 1, 1)
    assert member.level in written


def test_a_lure_written_above_moves_a_node_less_and_less_often() -> None:
    """Four records in every bucket of level 9 (some 2,000 keys, each ground to its bucket) look like a swarm of 2,000
    above a member of a swarm of 100: the member moves up, finds only them, walks back down, and reads above half as
    often each time, so the lure holds it for a shrinking share of its reads."""
    rng = random.Random(5)
    swarm = [f"peer-{i}" for i in range(100)]
    written = settled(100, 16).written_levels()
    member = settled(100, 16)
    lost = []
    for _ in range(3000):
        above = member.above_level()
        for level in (member.read_level(), *([above] if above is not None else [])):
            bucket = Bucket.random(level, rng)
            found = 4 if bucket.level == 9 else swarm_read(swarm, written, bucket)
            member.observe(bucket, found, found)
        lost.append(member.level not in written)
    assert any(lost[:500])  # the lure works at first
    assert sum(lost[-1000:]) < 0.05 * 1000, sum(lost[-1000:])


def test_a_node_whose_reads_find_nobody_for_a_while_probes_again() -> None:
    size = SwarmSize(32)
    size.observe(Bucket(3, 1), 30, 29)  # found at level 3
    assert not size.probing and size.read_level() == 3
    levels = []
    while not size.probing and len(levels) < 40:  # the estimate falls, and the level with it, to 0
        levels.append(size.level)
        size.observe(Bucket.random(size.read_level()), 0, 0)
    assert size.probing and levels[0] == 3 and levels[-1] == 0 and sorted(levels, reverse=True) == levels


def test_a_node_above_a_flood_that_reads_empty_buckets_lowers_its_level_and_does_not_probe_again() -> None:
    """A flood written at levels 0-4 (256 records a bucket up to level 3, 131 at 4: 2,100 keys) raises a node's
    estimate to level 5-6, where its buckets are empty: those reads lower the estimate, the level comes back down to
    the flood's, and the node never returns to probing (it once did every ~20 s, climbing again from level 0)."""
    size = SwarmSize(16)
    size.observe(Bucket(0, 0), 256, 256)  # the flooded level-0 bucket ends the probing
    seen = []
    for _ in range(300):
        level = size.read_level()
        records = 256 if level <= 3 else 131 if level == 4 else 0
        size.observe(Bucket.random(level), records, records)
        seen.append((size.level, size.probing))
    assert not any(probing for _, probing in seen)
    assert {level for level, _ in seen[100:]} <= {4, 5, 6}


@dataclass(frozen=True)
class Rec:
    peer_id: str


def test_a_bucket_read_replaces_what_the_view_held_of_that_bucket_only() -> None:
    view: RecordView[Rec] = RecordView(lambda _peer_id: False)
    later = get_dht_time() + 60
    peers = [f"p{i}" for i in range(64)]
    view.replace(Bucket(0, 0), [(Rec(p), later) for p in peers])
    assert len(view) == 64
    left = Bucket.of("p1", 2)
    stayed = [p for p in peers if left.holds(p) and p != "p1"]
    view.replace(left, [(Rec(p), later) for p in stayed])  # p1 left: its bucket no longer lists it
    assert {r.peer_id for r in view.records()} == set(peers) - {"p1"}
    view.replace(Bucket(0, 0), [(Rec("p2"), get_dht_time() - 1)])  # level 0 is the whole swarm; expired at once
    assert view.records() == []


def test_a_view_is_bounded_and_keeps_its_preferred_peers_first() -> None:
    view: RecordView[Rec] = RecordView(lambda peer_id: peer_id < "p005", limit=10)
    view.replace(Bucket(0, 0), [(Rec(f"p{i:03d}"), get_dht_time() + 60) for i in range(500)])
    kept = {r.peer_id for r in view.records()}
    assert len(view) == 10 and {f"p{i:03d}" for i in range(5)} <= kept


def test_a_dht_peer_keeps_a_bounded_number_of_entries_under_one_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(storage.DHTLocalStorage, "store_subkey", storage.DHTLocalStorage.store_subkey)  # restored
    bound_dictionaries(limit=8)
    held = storage.DHTLocalStorage()
    key = DHTID.generate(source="noloco/fp/peers/0/")
    expiration = get_dht_time() + 60
    stored = [held.store(key, b"v", expiration, subkey=f"k{i}") for i in range(20)]
    assert stored == [True] * 8 + [False] * 12
    assert held.store(key, b"newer", expiration + 1, subkey="k3")  # a member refreshes its own entry
    entries = held.get(key)
    assert entries is not None and len(entries.value) == 8 and entries.value.get("k3").value == b"newer"
