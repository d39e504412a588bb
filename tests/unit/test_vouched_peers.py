"""Peers with standing that the DHT stops listing (a partition expired their records) but that answer this node
directly: the watch keeps asking them, and their answers list them until the DHT does again (discovery/vouched.py,
node/report.py watch_peers). After a heal, the far side is back in a node's view within a second, not the 10-20 s
the DHT took; strangers are never listed this way."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest

from noloco_node.discovery.dht import Discovery, PeerRecord
from noloco_node.discovery.vouched import MAX_VOUCHED
from noloco_node.node import report
from noloco_node.observability.telemetry import Telemetry
from noloco_node.wire import peer_pb2 as pb


def _record(peer_id: str, step: int, updated: float | None = None) -> PeerRecord:
    return PeerRecord(peer_id, f"10.0.0.1:{len(peer_id)}", "run", outer_step=step, ready=True, updated=updated or 0.0)


def test_a_vouched_record_is_listed_until_the_dht_lists_the_peer_or_it_expires() -> None:
    discovery = Discovery("run", record_ttl=10)
    now = time.time()
    discovery.vouched.vouch(_record("far", 40, now))
    assert [r.outer_step for r in discovery.vouched.merged([])] == [40] and discovery.vouched.holds("far")
    listed = _record("far", 41, now)
    assert discovery.vouched.merged([listed]) == [listed] and not discovery.vouched.holds("far")  # the DHT's wins
    discovery.vouched.vouch(_record("old", 7, now - 11))
    assert discovery.vouched.merged([]) == []  # past record_ttl: gone
    for index in range(MAX_VOUCHED + 5):
        discovery.vouched.vouch(_record(f"p{index}", 1, now + index))
    assert len(discovery.vouched.merged([])) == MAX_VOUCHED  # bounded: the oldest went first
    assert not discovery.vouched.holds("p0") and discovery.vouched.holds(f"p{MAX_VOUCHED + 4}")


class _EnoughError(Exception):
    pass


def test_the_watch_lists_an_established_peer_the_dht_lost_from_its_answer_and_never_a_stranger(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    discovery = Discovery("run", record_ttl=10)
    rounds = [[_record("far", 12), _record("stranger", 12)], [], []]  # what the DHT lists at each round
    seen: list[dict[str, int]] = []
    telemetry = Telemetry(tokens_per_step=1, degraded_after=60, stall_after=60)

    async def live_peers() -> list[PeerRecord]:
        return discovery.vouched.merged(list(rounds[min(len(seen), len(rounds) - 1)]))

    asked: list[str] = []

    def fetch_info(address: str, *, timeout: float, transport: object, peer_id: str) -> pb.InfoReply:
        asked.append(peer_id)
        return pb.InfoReply(peer_id=peer_id, run_fingerprint="run", outer_step=40, ready_to_pair=True)

    async def sleep(_seconds: float) -> None:
        seen.append(telemetry.peer_steps())
        if len(seen) == 3:
            raise _EnoughError

    monkeypatch.setattr(discovery, "live_peers", live_peers)
    monkeypatch.setattr(report, "fetch_info", fetch_info)
    monkeypatch.setattr(report.asyncio, "sleep", sleep)
    with pytest.raises(_EnoughError):
        asyncio.run(
            report.watch_peers(
                discovery, telemetry, "run", "name", vouch_for=lambda peer: peer == "far", starts_every=1e9
            )
        )
    assert seen[0] == {"far": 40, "stranger": 40}  # both listed by the DHT; their Info said 40
    # The DHT lost both: the peer with standing is still asked and listed from its answer; the stranger is gone.
    assert seen[1] == {"far": 40} and seen[2] == {"far": 40}
    assert asked.count("stranger") == 1 and asked.count("far") == 3
    vouched = discovery.vouched.merged([])
    assert [replace(r, updated=0.0) for r in vouched] == [replace(_record("far", 40), inner_step=0)]


def test_the_watch_asks_a_listed_peer_again_only_at_its_next_outer_step_and_a_silent_one_every_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A peer's curve gains a point only at an outer step: its Info is asked again once its record shows a later
    step than its last answer did, and a peer whose Info failed is asked every round until it answers."""
    discovery = Discovery("run", record_ttl=10)
    # The DHT's listing at each round: "steady" stays at the step it answered with, then moves on; "mute" never answers.
    rounds = [
        [_record("steady", 40), _record("mute", 40)],
        [_record("steady", 40), _record("mute", 40)],
        [_record("steady", 40), _record("mute", 40)],
        [_record("steady", 41), _record("mute", 41)],
        [_record("steady", 41), _record("mute", 41)],
    ]
    telemetry = Telemetry(tokens_per_step=1, degraded_after=60, stall_after=60)
    done_rounds: list[int] = []
    asked: list[tuple[int, str]] = []

    async def live_peers() -> list[PeerRecord]:
        return list(rounds[min(len(done_rounds), len(rounds) - 1)])

    def fetch_info(address: str, *, timeout: float, transport: object, peer_id: str) -> pb.InfoReply:
        asked.append((len(done_rounds), peer_id))
        if peer_id == "mute":
            raise ConnectionError("no answer")
        step = rounds[min(len(done_rounds), len(rounds) - 1)][0].outer_step
        return pb.InfoReply(peer_id=peer_id, run_fingerprint="run", outer_step=step, ready_to_pair=True)

    async def sleep(_seconds: float) -> None:
        done_rounds.append(1)
        if len(done_rounds) == len(rounds):
            raise _EnoughError

    monkeypatch.setattr(discovery, "live_peers", live_peers)
    monkeypatch.setattr(report, "fetch_info", fetch_info)
    monkeypatch.setattr(report.asyncio, "sleep", sleep)
    with pytest.raises(_EnoughError):
        asyncio.run(report.watch_peers(discovery, telemetry, "run", "name", starts_every=1e9))
    assert [r for r, peer in asked if peer == "steady"] == [0, 3]  # its first round, then its next outer step
    assert [r for r, peer in asked if peer == "mute"] == [0, 1, 2, 3, 4]
