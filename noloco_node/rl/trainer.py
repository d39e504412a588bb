"""The RL node's trainer thread: one SAPO round after another (arXiv 2509.08721, Algorithm 1).

A round: draw I questions, sample G completions of each and score them with the family's verifier (rl/tasks.py),
publish them (the book serves them, the DHT record names the round), take up to J peers' rollouts from the pool
and score their completions here, then one GRPO update (algorithm.py) on the I + J groups. A node with J = 0, or
whose pool stays short (no peer yet, every peer gone) for ``--external-wait`` seconds, updates on what it has: no
peer can hold it longer than that.

Before the first round, ``--format-steps`` supervised steps on the reference answers teach a small model the
answer format, so that its first rewards are not all zero (the warm-up the docs name; a real 0.5B instruct model
needs none: set it to 0).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from statistics import fmean

import torch

from noloco_node.config.rl_config import RolloutConfig
from noloco_node.rl.policy import Policy, ScoredGroup
from noloco_node.rl.rollouts import ExternalPool, RolloutBook, SharedGroup
from noloco_node.rl.stats import RolloutStats
from noloco_node.rl.tasks import TaskError, TaskSampler, regenerate, score

log = logging.getLogger(__name__)


def score_external(groups: list[SharedGroup]) -> list[ScoredGroup]:
    """Peers' rollouts scored by this node: the question and answer regenerated from the reference, each completion
    judged by the verifier. Nothing the sender said about them is used."""
    scored = []
    for group in groups:
        try:
            task = regenerate(group.ref)
        except TaskError as error:  # decode_batch already refused these; a library change must not kill the trainer
            log.warning("cannot regenerate a peer's task %s: %s", group.ref, error)
            continue
        rewards = tuple(score(task, c) for c in group.completions)
        scored.append(ScoredGroup(task, group.completions, rewards, group.peer_id))
    return scored


class RolloutTrainer:
    def __init__(
        self,
        cfg: RolloutConfig,
        make_policy: Callable[[], Policy],
        *,
        seed: int,
        book: RolloutBook,
        pool: ExternalPool,
        stats: RolloutStats,
        stop: threading.Event,
        published: Callable[[int], None],
    ) -> None:
        self.cfg = cfg
        self.make_policy = make_policy  # called on this thread: torch starts its threads after the DHT has forked
        self.policy: Policy | None = None
        self.sampler = TaskSampler(cfg.tasks, seed)
        self.generator = torch.Generator().manual_seed(seed)
        self.book = book
        self.pool = pool
        self.stats = stats
        self.stop = stop
        self.published = published  # called on the trainer thread with the round just published
        self.round = 0
        self.warming_up = True

    def run(self) -> None:
        self.policy = policy = self.make_policy()
        self.warm_up(policy)
        self.warming_up = False
        for group in policy.optimizer.param_groups:
            group["lr"] = self.cfg.policy_lr
        while self.round < self.cfg.rounds and not self.stop.is_set():
            self.round += 1
            self.one_round(policy, self.round)
            if self.cfg.eval_every and (self.round % self.cfg.eval_every == 0 or self.round == self.cfg.rounds):
                self.evaluate(policy, self.round)

    def warm_up(self, policy: Policy) -> None:
        for group in policy.optimizer.param_groups:
            group["lr"] = self.cfg.format_lr
        losses = []
        for _ in range(self.cfg.format_steps):
            if self.stop.is_set():
                return
            losses.append(policy.supervised_step(self.sampler.draw(self.cfg.format_batch)))
        if losses:
            log.info("format warm-up: %d supervised steps, loss %.3f -> %.3f", len(losses), losses[0], losses[-1])

    def one_round(self, policy: Policy, round_: int) -> None:
        local = []
        for task in self.sampler.draw(self.cfg.local):
            completions = tuple(policy.sample(task.prompt, self.cfg.group_size, self.generator))
            local.append(ScoredGroup(task, completions, tuple(score(task, c) for c in completions)))
        if local:
            self.book.publish(round_, [SharedGroup(g.task.ref, g.completions) for g in local])
            self.published(round_)
        external = []
        if self.cfg.external:
            self.pool.wait_for(self.cfg.external, self.cfg.external_wait, self.stop)
            external = score_external(self.pool.take(self.cfg.external))
        groups = [*local, *external]  # none when I = 0 and no peer's rollouts came: nothing to learn from this round
        loss = policy.grpo_step(groups, steps=self.cfg.policy_steps, clip=self.cfg.clip) if groups else 0.0
        self.stats.record_round(round_, local, external, loss)

    def evaluate(self, policy: Policy, round_: int) -> None:
        """Greedy answers to each family's fixed held-out questions (those it trains on and --eval-tasks), and the
        reference answers' likelihood."""
        for family in dict.fromkeys([*self.cfg.tasks, *self.cfg.eval_tasks]):
            tasks = self.sampler.evaluation(family, self.cfg.eval_questions)
            rewards = [score(t, policy.sample(t.prompt, 1, self.generator, greedy=True)[0]) for t in tasks]
            self.stats.record_eval(round_, family, fmean(rewards), policy.answer_nll(tasks))
