"""What a node remembers about its own progress and its peers, for the status endpoint, /metrics and Info.

The trainer thread reports inner steps, outer steps and checkpoints; the event loop reports what the DHT and the
peers' Info calls said. Everything here is plain numbers under one lock (no torch), so that serving status costs
the trainer nothing. The health verdict (a node must say why it is unwell) is computed here too.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, SupportsFloat

from noloco_node.discovery.dht import PeerRecord, RunStart
from noloco_node.observability.status import Health, KnownPeer, LossPoint
from noloco_node.wire import peer_pb2 as pb

log = logging.getLogger(__name__)

RECENT_STEPS = 50  # inner steps behind "train loss (recent mean)" and tokens/s
KEEP_OUTER_STEPS = 1000


@dataclass
class PeerView:
    record: PeerRecord
    seen: float  # time.time() of the DHT lookup that listed it
    info: pb.InfoReply | None = None
    info_time: float | None = None
    live_step: int | None = None  # the outer step the peer itself last said (its Info, an out-of-reach refusal)
    live_step_time: float = 0.0  # when it said so; a record written later supersedes it


@dataclass
class HealthInputs:
    """The node's side of the health verdict: facts only the node knows."""

    trainer_started: bool
    trainer_alive: bool
    trainer_error: BaseException | None
    stopping: bool
    finished: bool
    dht_alive: bool
    task_problem: str | None = None  # a supervised background task that gave up (node/supervisor.py)


@dataclass
class Telemetry:
    tokens_per_step: int
    degraded_after: float  # seconds without any live peer before the node says so
    stall_after: float  # seconds without trainer progress before the node is unhealthy
    started: float = field(default_factory=time.time)
    training_started: float | None = None  # time.time() of the first inner step's start (after --wait-for-peers)
    phase: str = "loading the model and data"
    step_plan: dict[str, Any] | None = None  # how this member runs its inner step (training/step_plan.py)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        # (inner step, loss, seconds)
        self._steps: deque[tuple[int, SupportsFloat, float]] = deque(maxlen=RECENT_STEPS)
        self.history: deque[dict[str, Any]] = deque(maxlen=KEEP_OUTER_STEPS)
        self.train_seconds_total = 0.0
        self.wait_seconds_total = 0.0
        self.blends_since_start = 0  # outer steps of this process blended with a partner
        self.last_checkpoint: float | None = None
        self.last_progress = time.monotonic()
        self.last_peer_seen = time.monotonic()
        self.learning_rate: float | None = None
        self._peers: dict[str, PeerView] = {}
        self.refused_starts: dict[str, str] = {}  # peer id -> why it and this node never pair

    # ---------------------------------------------------------------------------------- trainer thread

    def on_inner_step(self, inner_step: int, loss: SupportsFloat, seconds: float, learning_rate: float) -> None:
        """``loss`` is read when a figure is asked for (training/replica.py StepLoss: on a GPU a step's loss is
        there only once the step has run), never here on the trainer thread."""
        with self._lock:
            self._steps.append((inner_step, loss, seconds))
            self.learning_rate = learning_rate
            self.last_progress = time.monotonic()

    def on_outer_step(self, record: dict[str, Any]) -> None:
        with self._lock:
            self.history.append(record)
            self.train_seconds_total += record["train_seconds"]
            self.wait_seconds_total += record["wait_seconds"]
            self.blends_since_start += 1 if record.get("partner") else 0
            self.last_progress = time.monotonic()

    def restore_history(self, records: list[dict[str, Any]]) -> None:
        """The outer steps of this node's earlier life, from its checkpoint (their times count in the totals)."""
        with self._lock:
            for record in records:
                self.history.append(record)
                self.train_seconds_total += record["train_seconds"]
                self.wait_seconds_total += record["wait_seconds"]

    def on_checkpoint(self) -> None:
        self.last_checkpoint = time.time()

    def beat(self) -> None:
        """The trainer is alive and waiting on purpose (a pairing round, a download)."""
        self.last_progress = time.monotonic()

    # ---------------------------------------------------------------------------------- event loop

    def on_peers(self, records: list[PeerRecord]) -> None:
        """A DHT lookup's live peers of the run (this node excluded); peers no longer listed are forgotten."""
        now = time.time()
        with self._lock:
            live = {record.peer_id for record in records}
            for gone in set(self._peers) - live:
                del self._peers[gone]
            for record in records:
                view = self._peers.get(record.peer_id)
                if view is None:
                    self._peers[record.peer_id] = PeerView(record, now)
                else:
                    view.record, view.seen = record, now
            if records:
                self.last_peer_seen = time.monotonic()

    def peer_steps(self) -> dict[str, int]:
        """The outer step of each live peer: as the last DHT lookup saw it, or as the peer's server said since (in
        an out-of-reach refusal or its Info): a record may lag its node, and a node left behind must not believe a
        peer within reach that is not."""
        with self._lock:
            return {
                peer_id: view.live_step
                if view.live_step is not None and view.record.updated < view.live_step_time
                else view.record.outer_step
                for peer_id, view in self._peers.items()
            }

    def on_live_step(self, peer_id: str, outer_step: int) -> None:
        """A live peer's server refused this node as out of reach and said which outer step it is at."""
        with self._lock:
            view = self._peers.get(peer_id)
            if view is not None:  # only peers the DHT lists: a refusal cannot add one
                view.live_step, view.live_step_time = outer_step, time.time()

    def on_other_starts(self, others: list[RunStart], run_name: str, own: dict[str, str]) -> None:
        """Nodes of this run's name that started elsewhere: each said once in the log, all shown in /status."""
        for other in others:
            if other.peer_id in self.refused_starts or len(self.refused_starts) >= 64:
                continue  # said once per peer, and at most 64 of them: a stranger minting keys cannot flood the log
            message = other.refusal(run_name, own)
            log.warning("%s", message)
            self.refused_starts[other.peer_id] = message

    def on_info(self, peer_id: str, reply: pb.InfoReply) -> None:
        """A live peer's Info (the watch asks every few seconds): its curve, and its outer step, which is fresher
        than its DHT record. Right after a partition heals, the far side's records still carry the steps of before
        the split for a while; the steps they answer with now are what tells a node that half the swarm is ahead
        (pairing/standing.py swarm_step), a few seconds after the heal rather than whenever the DHT catches up."""
        with self._lock:
            view = self._peers.get(peer_id)
            if view is not None:
                now = time.time()
                view.info, view.info_time = reply, now
                view.live_step, view.live_step_time = reply.outer_step, now

    def peer_addresses(self) -> list[tuple[str, str]]:
        with self._lock:
            return [(peer_id, view.record.address) for peer_id, view in self._peers.items()]

    # ---------------------------------------------------------------------------------- reading

    def _finished_steps(self) -> list[SupportsFloat]:
        """The recent steps' losses that can be read without waiting for the device (all of them on a CPU)."""
        with self._lock:
            return [loss for _, loss, _ in self._steps if getattr(loss, "done", True)]

    def train_loss(self) -> float | None:
        losses = [float(loss) for loss in self._finished_steps()]
        return sum(losses) / len(losses) if losses else None

    def grad_norm(self) -> float | None:
        """Mean gradient norm (before clipping) of the recent inner steps."""
        norms = [
            float(n) for n in (getattr(loss, "grad_norm", None) for loss in self._finished_steps()) if n is not None
        ]
        return sum(norms) / len(norms) if norms else None

    def tokens_per_second(self) -> float | None:
        """Training throughput over the recent inner steps: their tokens over the time the steps themselves took."""
        with self._lock:
            seconds = sum(s for _, _, s in self._steps)
            count = len(self._steps)
        return count * self.tokens_per_step / seconds if seconds > 0 else None

    def comm_wait_fraction(self) -> float:
        total = self.train_seconds_total + self.wait_seconds_total
        return self.wait_seconds_total / total if total > 0 else 0.0

    def val_loss(self) -> float | None:
        with self._lock:
            return self.history[-1]["val_loss"] if self.history else None

    def history_list(self, last: int) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.history)[-last:]

    def loss_points(self, last: int) -> list[LossPoint]:
        """This node's curve (one point per outer step) for the page and for peers' Info calls."""
        return [
            LossPoint(inner_step=h["inner_step"], train_loss=h["train_loss"], val_loss=h["val_loss"], time=h["time"])
            for h in self.history_list(last)
        ]

    def known_peers(self) -> list[KnownPeer]:
        now = time.time()
        with self._lock:
            views = list(self._peers.values())
        peers = []
        for view in views:
            info = view.info
            peers.append(
                KnownPeer(
                    peer_id=view.record.peer_id,
                    address=view.record.address,
                    outer_step=view.record.outer_step,
                    inner_step=view.record.inner_step,
                    ready=view.record.ready,
                    record_age_seconds=max(0.0, now - view.record.updated) if view.record.updated else 0.0,
                    health=info.health if info else None,
                    train_loss=_finite_or_none(info.train_loss) if info and info.HasField("train_loss") else None,
                    val_loss=_finite_or_none(info.val_loss) if info and info.HasField("val_loss") else None,
                    history=[
                        LossPoint(
                            inner_step=p.inner_step,
                            train_loss=p.train_loss,
                            val_loss=_finite_or_none(p.val_loss),
                            time=p.time,
                        )
                        for p in (info.history if info else [])
                        if math.isfinite(p.train_loss)
                    ],
                    info_age_seconds=now - view.info_time if view.info_time else None,
                )
            )
        return sorted(peers, key=lambda p: p.peer_id)

    def health(self, facts: HealthInputs) -> Health:
        if facts.trainer_error is not None:
            return Health(state="failed", reason=f"trainer thread died: {facts.trainer_error!r}", ok=False)
        if facts.finished:
            return Health(state="finished", reason="reached total_steps", ok=False)
        if facts.stopping:
            return Health(state="stopping", reason="shutting down: final checkpoint, leaving the DHT", ok=False)
        if not facts.trainer_started:
            return Health(state="starting", reason=self.phase, ok=False)
        if not facts.trainer_alive:
            return Health(state="failed", reason="the trainer thread is not running", ok=False)
        if facts.task_problem is not None:
            return Health(state="failed", reason=facts.task_problem, ok=False)
        if not facts.dht_alive:
            return Health(state="degraded", reason="the DHT process died: peers cannot find this node", ok=False)
        stalled = time.monotonic() - self.last_progress
        if stalled > self.stall_after:
            return Health(state="degraded", reason=f"trainer made no progress for {stalled:.0f} s", ok=False)
        alone = time.monotonic() - self.last_peer_seen
        if alone > self.degraded_after:
            # Still training (solo steps), so /healthz stays 200: restarting would not bring peers back.
            return Health(state="degraded", reason=f"no peers for {_duration(alone)}", ok=True)
        return Health(state="training", reason="", ok=True)


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 120 else f"{seconds:.0f} s"
