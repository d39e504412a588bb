"""What an RL node measures of itself: its reward curves (local and from the swarm, per task family), its
evaluations, and what it served, fetched, used and refused; kept for /status and counted for /metrics.

Thread-safe: the trainer thread records rounds, gRPC threads serve, the fetcher counts, the event loop reads.
"""

from __future__ import annotations

import threading
import time
from collections import Counter as Tally
from collections import deque
from statistics import fmean

from prometheus_client import CollectorRegistry, Counter, Gauge

from noloco_node.observability.rl_status import EvalPoint, FamilyStatus, RewardPoint
from noloco_node.rl.policy import ScoredGroup

MAX_POINTS = 500
RECENT_ROUNDS = 10


def mean_reward(groups: list[ScoredGroup]) -> float | None:
    rewards = [r for g in groups for r in g.rewards]
    return fmean(rewards) if rewards else None


class RolloutStats:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._lock = threading.Lock()
        self.points: deque[RewardPoint] = deque(maxlen=MAX_POINTS)
        self.evaluations: deque[EvalPoint] = deque(maxlen=MAX_POINTS)
        self.cumulative_local_reward = 0.0
        self.used = Tally[str]()  # (source:family) -> rollouts trained on
        self._recent: deque[tuple[list[ScoredGroup], list[ScoredGroup]]] = deque(maxlen=RECENT_ROUNDS)
        self.fetched = 0
        self.by_peer: dict[str, list[float]] = {}  # peer id -> [rollouts used, sum of their mean rewards]
        self.refused = Tally[str]()
        self.fetch_failures = Tally[str]()
        self._rollouts = Counter(
            "noloco_rl_rollouts", "Rollouts (question groups) trained on, by source and family.",
            ["source", "family"], registry=registry,
        )  # fmt: skip
        self._refused = Counter(
            "noloco_rl_rollouts_refused", "Fetched rollout batches refused, by reason.", ["reason"], registry=registry
        )
        self._fetched = Counter(
            "noloco_rl_rollouts_fetched", "Peers' rollouts fetched and accepted.", registry=registry
        )
        self._reward = Gauge(
            "noloco_rl_reward", "Mean reward of the last round, by source.", ["source"], registry=registry
        )
        self._round = Gauge("noloco_rl_round", "Rounds (updates) done.", registry=registry)

    def record_round(self, round_: int, local: list[ScoredGroup], external: list[ScoredGroup], loss: float) -> None:
        local_reward, external_reward = mean_reward(local), mean_reward(external)
        families = sorted({g.task.ref.family for g in local})
        point = RewardPoint(
            round=round_,
            time=time.time(),
            local_reward=local_reward,
            external_reward=external_reward,
            local_groups=len(local),
            external_groups=len(external),
            loss=loss,
            by_family={
                f: r for f in families if (r := mean_reward([g for g in local if g.task.ref.family == f])) is not None
            },
        )
        with self._lock:
            self.points.append(point)
            self._recent.append((local, external))
            self.cumulative_local_reward += local_reward or 0.0
            for group in external:
                used = self.by_peer.setdefault(group.peer_id, [0.0, 0.0])
                used[0] += 1
                used[1] += fmean(group.rewards)
            for source, groups in (("local", local), ("external", external)):
                for group in groups:
                    self.used[f"{source}:{group.task.ref.family}"] += 1
                    self._rollouts.labels(source, group.task.ref.family).inc()
        self._round.set(round_)
        for source, reward in (("local", local_reward), ("external", external_reward)):
            if reward is not None:
                self._reward.labels(source).set(reward)

    def record_eval(self, round_: int, family: str, reward: float, answer_nll: float) -> None:
        with self._lock:
            self.evaluations.append(EvalPoint(round=round_, family=family, reward=reward, answer_nll=answer_nll))

    def accepted(self, groups: int) -> None:
        with self._lock:
            self.fetched += groups
        self._fetched.inc(groups)

    def refusal(self, reason: str) -> None:
        with self._lock:
            self.refused[reason] += 1
        self._refused.labels(reason).inc()

    def fetch_failed(self, code: str) -> None:
        with self._lock:
            self.fetch_failures[code] += 1

    def peer_contribution(self, peer_id: str) -> tuple[int, float | None]:
        """The rollouts of ``peer_id`` this node trained on, and their mean reward as this node scored them."""
        with self._lock:
            used, total = self.by_peer.get(peer_id, (0.0, 0.0))
        return int(used), (total / used if used else None)

    @property
    def external_used(self) -> int:
        with self._lock:
            return sum(n for key, n in self.used.items() if key.startswith("external:"))

    def families(self, families: list[str]) -> list[FamilyStatus]:
        with self._lock:
            recent = list(self._recent)
            used = dict(self.used)
            latest_eval = {e.family: e.reward for e in self.evaluations}
        seen = sorted({*families, *latest_eval, *(k.split(":", 1)[1] for k in used)})
        out = []
        for family in seen:
            local = [g for lo, _ in recent for g in lo if g.task.ref.family == family]
            external = [g for _, ex in recent for g in ex if g.task.ref.family == family]
            out.append(
                FamilyStatus(
                    family=family,
                    local_rollouts=used.get(f"local:{family}", 0),
                    external_rollouts=used.get(f"external:{family}", 0),
                    local_reward=mean_reward(local),
                    external_reward=mean_reward(external),
                    eval_reward=latest_eval.get(family),
                )
            )
        return out
