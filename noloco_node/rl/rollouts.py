"""Rollouts as they are shared: what a node serves of its own rounds, how a received batch is checked, and the pool
of peers' rollouts an update draws its J external ones from (SAPO, arXiv 2509.08721, section 3: a node's
training set is I of its own rollouts and J sampled from the swarm's shared ones).

A rollout is one question's group of G completions, named by task reference (rl/tasks.py); nothing else crosses.
A received batch is taken whole or not at all: one malformed group refuses the batch (``RolloutError`` with the
reason it is counted under), and the pool is unchanged. Rewards are never received: the trainer scores every
external completion itself when it uses it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

from noloco_node.errors import NolocoError
from noloco_node.rl.tasks import DATASET_SIZE, TaskRef, known_family
from noloco_node.wire import peer_pb2 as pb

MAX_GROUPS = 64  # a round's rollouts; SAPO's settings use 8 per update
MIN_COMPLETIONS, MAX_COMPLETIONS = 2, 64  # GRPO needs two completions to normalise within a group
MAX_COMPLETION_CHARS = 4096
MAX_BATCH_BYTES = 4 * 1024 * 1024  # the channel's receive limit: a larger reply is RESOURCE_EXHAUSTED
ROUNDS_SERVED = 4  # a node serves its last few rounds; an older one is NOT_FOUND (stale)
MAX_POOL_GROUPS = 256  # external groups held at once, the oldest dropped first


class RolloutError(NolocoError):
    """A batch that is not taken; ``reason`` is the label it is counted under."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class SharedGroup:
    """One rollout as it crosses the swarm: a task reference and its completions, from ``peer_id``'s round."""

    ref: TaskRef
    completions: tuple[str, ...]
    peer_id: str = ""
    round: int = 0


def encode_batch(run_fingerprint: str, peer_id: str, round_: int, groups: list[SharedGroup]) -> pb.RolloutBatch:
    return pb.RolloutBatch(
        run_fingerprint=run_fingerprint,
        peer_id=peer_id,
        round=round_,
        groups=[
            pb.RolloutGroup(family=g.ref.family, seed=g.ref.seed, index=g.ref.index, completions=list(g.completions))
            for g in groups
        ],
    )


def decode_batch(batch: pb.RolloutBatch, *, run_fingerprint: str, peer_id: str, round_: int) -> list[SharedGroup]:
    """The groups of a batch fetched from ``peer_id`` for ``round_``, or RolloutError naming what is wrong."""
    if batch.run_fingerprint != run_fingerprint:
        raise RolloutError("run", f"rollouts of another run ({batch.run_fingerprint[:16]!r})")
    if batch.peer_id != peer_id:
        raise RolloutError("peer", f"rollouts signed as {batch.peer_id[:16]!r}, asked of {peer_id[:16]!r}")
    if batch.round != round_:
        raise RolloutError("round", f"rollouts of round {batch.round}, asked for round {round_}")
    if len(batch.groups) > MAX_GROUPS:
        raise RolloutError("too_many_groups", f"{len(batch.groups)} groups (at most {MAX_GROUPS})")
    groups = []
    for position, group in enumerate(batch.groups):
        where = f"group {position}"
        if not known_family(group.family):
            raise RolloutError("unknown_family", f"{where}: unknown task family {group.family[:64]!r}")
        if group.index >= DATASET_SIZE or group.seed >= 2**63:
            raise RolloutError("task_range", f"{where}: task index {group.index} or seed {group.seed} out of range")
        if not MIN_COMPLETIONS <= len(group.completions) <= MAX_COMPLETIONS:
            raise RolloutError(
                "group_size", f"{where}: {len(group.completions)} completions ({MIN_COMPLETIONS}-{MAX_COMPLETIONS})"
            )
        if any(len(c) > MAX_COMPLETION_CHARS for c in group.completions):
            raise RolloutError("completion_too_long", f"{where}: a completion over {MAX_COMPLETION_CHARS} characters")
        ref = TaskRef(group.family, int(group.seed), int(group.index))
        groups.append(SharedGroup(ref, tuple(group.completions), peer_id, round_))
    return groups


class RolloutBook:
    """This node's own rollouts of its last ROUNDS_SERVED rounds, served to peers (thread-safe: the trainer
    writes, gRPC threads read)."""

    def __init__(self, run_fingerprint: str, peer_id: str) -> None:
        self.run_fingerprint = run_fingerprint
        self.peer_id = peer_id
        self._rounds: OrderedDict[int, pb.RolloutBatch] = OrderedDict()
        self._lock = threading.Lock()
        self.served_batches = 0
        self.served_groups = 0

    def publish(self, round_: int, groups: list[SharedGroup]) -> None:
        batch = encode_batch(self.run_fingerprint, self.peer_id, round_, groups)
        with self._lock:
            self._rounds[round_] = batch
            while len(self._rounds) > ROUNDS_SERVED:
                self._rounds.popitem(last=False)

    @property
    def latest_round(self) -> int:
        with self._lock:
            return next(reversed(self._rounds)) if self._rounds else -1

    def batch(self, round_: int) -> pb.RolloutBatch | None:
        """The batch of ``round_`` (counted as served), or None when this node no longer holds it."""
        with self._lock:
            batch = self._rounds.get(round_)
            if batch is not None:
                self.served_batches += 1
                self.served_groups += len(batch.groups)
            return batch


class ExternalPool:
    """Peers' rollouts fetched and not yet used, newest first; each is trained on once at most, and none older than
    ``max_age`` seconds (thread-safe: the fetcher adds, the trainer takes)."""

    def __init__(self, max_age: float) -> None:
        self.max_age = max_age
        self._groups: deque[tuple[float, SharedGroup]] = deque()
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self.stale = 0  # groups dropped unused because they grew too old

    def add(self, groups: list[SharedGroup], *, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._groups.extend((now, g) for g in groups)
            while len(self._groups) > MAX_POOL_GROUPS:
                self._groups.popleft()
            self._arrived.notify_all()

    def wait_for(self, count: int, timeout: float, stop: threading.Event) -> None:
        """Return once ``count`` groups are held, ``timeout`` seconds have passed, or ``stop`` is set: an update
        waits this long at most for its J external rollouts, then goes on with what there is."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while len(self._groups) < count and not stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._arrived.wait(min(left, 0.1))

    def take(self, count: int, *, now: float | None = None) -> list[SharedGroup]:
        """Up to ``count`` of the freshest unused groups, spread over peers (one from each in turn)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            fresh = [(t, g) for t, g in self._groups if now - t <= self.max_age]
            self.stale += len(self._groups) - len(fresh)
            by_peer: dict[str, list[tuple[float, SharedGroup]]] = {}
            for item in reversed(fresh):  # newest first
                by_peer.setdefault(item[1].peer_id, []).append(item)
            chosen: list[tuple[float, SharedGroup]] = []
            while len(chosen) < count and any(by_peer.values()):
                for items in by_peer.values():
                    if items and len(chosen) < count:
                        chosen.append(items.pop(0))
            taken = {id(item[1]) for item in chosen}
            self._groups = deque(item for item in fresh if id(item[1]) not in taken)
            return [g for _, g in chosen]

    def __len__(self) -> int:
        with self._lock:
            return len(self._groups)
