"""telemetry.py: the health verdict and its reasons, and the numbers /status reports."""

from __future__ import annotations

import asyncio
import time
from typing import ClassVar

import pytest

from noloco_node.discovery.dht import PeerRecord
from noloco_node.observability.telemetry import HealthInputs, Telemetry
from noloco_node.wire import peer_pb2 as pb

HEALTHY = HealthInputs(
    trainer_started=True, trainer_alive=True, trainer_error=None, stopping=False, finished=False, dht_alive=True
)


def telemetry(**kwargs: float) -> Telemetry:
    return Telemetry(tokens_per_step=512, degraded_after=kwargs.get("degraded_after", 600), stall_after=60)


def facts(**changes: object) -> HealthInputs:
    return HealthInputs(**{**HEALTHY.__dict__, **changes})


@pytest.mark.parametrize(
    ("changes", "state", "ok", "reason"),
    [
        ({}, "training", True, ""),
        ({"trainer_error": RuntimeError("boom")}, "failed", False, "trainer thread died: RuntimeError('boom')"),
        ({"finished": True}, "finished", False, "reached total_steps"),
        ({"stopping": True}, "stopping", False, "shutting down"),
        ({"trainer_started": False, "trainer_alive": False}, "starting", False, "loading the model"),
        ({"trainer_alive": False}, "failed", False, "not running"),
        ({"dht_alive": False}, "degraded", False, "DHT process died"),
    ],
)
def test_health_states_say_why(changes: dict, state: str, ok: bool, reason: str) -> None:
    health = telemetry().health(facts(**changes))
    assert (health.state, health.ok) == (state, ok) and reason in health.reason


def test_a_stalled_trainer_is_unhealthy_and_no_peers_only_degrades() -> None:
    watch = telemetry(degraded_after=600)
    watch.last_progress = time.monotonic() - 61
    stalled = watch.health(HEALTHY)
    assert (stalled.state, stalled.ok) == ("degraded", False) and "no progress for 61 s" in stalled.reason
    watch.beat()
    watch.last_peer_seen = time.monotonic() - 601
    alone = watch.health(HEALTHY)
    assert (alone.state, alone.ok) == ("degraded", True) and alone.reason == "no peers for 10 min"
    assert str(alone) == "degraded: no peers for 10 min"


def test_losses_throughput_and_waiting() -> None:
    watch = telemetry()
    assert watch.train_loss() is None and watch.tokens_per_second() is None and watch.comm_wait_fraction() == 0
    for step in range(1, 61):
        watch.on_inner_step(step, float(step), 0.5, 1e-3)
    assert watch.train_loss() == pytest.approx(sum(range(11, 61)) / 50)  # the last 50 steps only
    assert watch.tokens_per_second() == pytest.approx(512 / 0.5)
    watch.on_outer_step(
        {"train_seconds": 3.0, "wait_seconds": 1.0, "val_loss": 2.5, "inner_step": 60, "time": 0.0, "train_loss": 3.0}
    )
    assert watch.comm_wait_fraction() == pytest.approx(0.25) and watch.val_loss() == 2.5
    assert [p.inner_step for p in watch.loss_points(10)] == [60]


def test_peers_come_and_go_with_their_info() -> None:
    watch = telemetry()
    a = PeerRecord(peer_id="a", address="h:1", run_fingerprint="r", outer_step=3, updated=time.time() - 2)
    b = PeerRecord(peer_id="b", address="h:2", run_fingerprint="r", outer_step=4, updated=time.time())
    watch.on_peers([a, b])
    watch.on_info(
        "a",
        pb.InfoReply(
            peer_id="a",
            health="training",
            val_loss=2.0,
            history=[pb.LossPoint(inner_step=10, train_loss=3.0, val_loss=float("nan"), time=1.0)],
        ),
    )
    peers = {p.peer_id: p for p in watch.known_peers()}
    assert peers["a"].health == "training" and peers["a"].val_loss == 2.0 and peers["a"].train_loss is None
    assert peers["a"].history[0].val_loss is None  # NaN on the wire means "not evaluated"
    assert peers["a"].record_age_seconds == pytest.approx(2, abs=0.5) and peers["b"].health is None
    watch.on_peers([b])
    assert [p.peer_id for p in watch.known_peers()] == ["b"]


class _EnoughError(Exception):
    """Ends watch_peers' endless loop once the test has seen enough lookups."""


def test_other_starts_are_looked_up_often_at_first_then_every_30_s(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run's members mostly start together: a node started from another model must be named within seconds, and
    a long-lived node must not ask the DHT every 3 s for what changes only when someone starts anew."""
    from noloco_node.node import report

    clock = [0.0]
    real_sleep = asyncio.sleep

    async def sleep(seconds: float) -> None:  # time passes only where watch_peers waits
        clock[0] += seconds
        await real_sleep(0)

    monkeypatch.setattr(report.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(report.asyncio, "sleep", sleep)
    looked_up: list[float] = []

    class Discovery:
        run_start: ClassVar[dict[str, str]] = {}

        async def live_peers(self) -> list[PeerRecord]:
            return []

        async def other_starts(self) -> list:
            looked_up.append(clock[0])
            if len(looked_up) == 8:
                raise _EnoughError
            return []

    with pytest.raises(_EnoughError):
        asyncio.run(report.watch_peers(Discovery(), telemetry(), "run", "name", every=3.0, starts_every=30.0))  # type: ignore[arg-type]
    assert looked_up == [0.0, 3.0, 9.0, 21.0, 45.0, 75.0, 105.0, 135.0]


def test_a_peers_own_word_on_its_outer_step_holds_until_a_newer_record() -> None:
    """A node left behind learns a live peer's outer step from the peer's out-of-reach refusal: its DHT record may
    lag a step, and a node three steps behind once stayed solo for 60 outer steps believing the record."""
    telemetry = Telemetry(tokens_per_step=1, degraded_after=60, stall_after=60)
    written = time.time() - 5
    telemetry.on_peers([PeerRecord("p", "10.0.0.1:1", "run", outer_step=5, updated=written)])
    telemetry.on_live_step("stranger", 1000)  # a peer the DHT does not list: ignored
    telemetry.on_live_step("p", 8)
    assert telemetry.peer_steps() == {"p": 8}
    telemetry.on_peers([PeerRecord("p", "10.0.0.1:1", "run", outer_step=9, updated=time.time() + 1)])
    assert telemetry.peer_steps() == {"p": 9}  # a record written after the refusal supersedes it


def test_a_peers_info_says_its_outer_step_before_its_record_does() -> None:
    """After a partition heals, the far side's records still carry their steps of before the split: the step a
    peer's Info answers with (the watch asks every 3 s) is the one the node acts on until a newer record comes."""
    telemetry = Telemetry(tokens_per_step=1, degraded_after=60, stall_after=60)
    telemetry.on_peers([PeerRecord("p", "10.0.0.1:1", "run", outer_step=5, updated=time.time() - 5)])
    telemetry.on_info("stranger", pb.InfoReply(peer_id="stranger", outer_step=1000))  # not listed: ignored
    telemetry.on_info("p", pb.InfoReply(peer_id="p", outer_step=40))
    assert telemetry.peer_steps() == {"p": 40}
    telemetry.on_peers([PeerRecord("p", "10.0.0.1:1", "run", outer_step=41, updated=time.time() + 1)])
    assert telemetry.peer_steps() == {"p": 41}
