"""Verifiable tasks for RL post-training: reasoning-gym's generators and verifiers, addressed by reference.

A rollout never carries its question or its reward: it carries a *task reference* (family, seed, index), and
every node that receives it regenerates the question and the answer from that reference and scores the
completions itself with the family's own verifier (SAPO, arXiv 2509.08721, section 3: each node scores every
rollout with its own reward model). A peer therefore cannot lie about a question, an answer or a reward: all it
chooses is its completions text.

A *family* is a reasoning-gym dataset with a fixed configuration. The presets below are small enough for a model
that trains on a CPU in minutes (one-digit sums, backward spelling of short words); any other reasoning-gym
dataset name is a family too, with the library's default configuration (for a real 0.5B model on a GPU).
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Any

from noloco_node.errors import NolocoError

# Families that a small model learns on a CPU within minutes; their configurations are part of the family name's
# meaning, so every node regenerates the same questions from the same reference.
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "chain_sum": ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}),
    "spell_backward": ("spell_backward", {"min_word_len": 3, "max_word_len": 4}),
}
DATASET_SIZE = 1_000_000  # reasoning-gym datasets generate item i from (seed, i) on demand: the size is a bound
MAX_FAMILY_CHARS = 64


class TaskError(NolocoError):
    """A task reference nobody can regenerate: an unknown family, or an index out of range."""


@dataclass(frozen=True)
class TaskRef:
    """What a rollout says of its question: enough for any node to regenerate it, nothing to believe."""

    family: str
    seed: int
    index: int


@dataclass(frozen=True)
class Task:
    ref: TaskRef
    question: str
    answer: str
    entry: dict[str, Any]  # reasoning-gym's item, which its verifier scores against

    @property
    def prompt(self) -> str:
        return prompt_for(self.question)


def prompt_for(question: str) -> str:
    """The text a policy continues: the question, then "Answer: "; a completion ends at its first newline."""
    return f"{question}\nAnswer: "


def known_family(family: str) -> bool:
    if family in PRESETS:
        return True
    try:
        import reasoning_gym.factory as factory
    except ImportError:  # pragma: no cover - a dependency of the package
        return False
    return len(family) <= MAX_FAMILY_CHARS and family in factory.DATASETS


def check_families(families: list[str]) -> list[str]:
    """The families a node asks for, or TaskError naming the one reasoning-gym does not know."""
    for family in families:
        if not known_family(family):
            raise TaskError(
                f"unknown task family {family!r} (known: {', '.join(sorted(PRESETS))}, or any reasoning-gym dataset)"
            )
    if not families:
        raise TaskError("no task family given")
    return families


@functools.lru_cache(maxsize=64)
def _dataset(family: str, seed: int) -> Any:
    import reasoning_gym

    name, config = PRESETS.get(family, (family, {}))
    return reasoning_gym.create_dataset(name, size=DATASET_SIZE, seed=seed, **config)


def regenerate(ref: TaskRef) -> Task:
    """The question and answer behind ``ref``, generated here (TaskError for a reference nobody can regenerate)."""
    if not known_family(ref.family):
        raise TaskError(f"unknown task family {ref.family!r}")
    if not 0 <= ref.index < DATASET_SIZE or not 0 <= ref.seed < 2**63:
        raise TaskError(f"task index {ref.index} or seed {ref.seed} out of range")
    entry = _dataset(ref.family, ref.seed)[ref.index]
    return Task(ref=ref, question=str(entry["question"]), answer=str(entry["answer"]), entry=entry)


def score(task: Task, completion: str) -> float:
    """The family's own verifier on one completion (its first line, stripped): a reward in [0, 1]."""
    answer = completion.split("\n", 1)[0].strip()
    reward = float(_dataset(task.ref.family, task.ref.seed).score_answer(answer, task.entry))
    return min(1.0, max(0.0, reward))


class TaskSampler:
    """The questions one node draws: its families in turn, at random indices drawn from its own seed."""

    def __init__(self, families: list[str], seed: int) -> None:
        self.families = check_families(families)
        self.seed = seed
        self._random = random.Random(seed)

    def draw(self, count: int) -> list[Task]:
        refs = [
            TaskRef(self.families[i % len(self.families)], self.seed, self._random.randrange(DATASET_SIZE))
            for i in range(count)
        ]
        return [regenerate(ref) for ref in refs]

    def evaluation(self, family: str, count: int) -> list[Task]:
        """Fixed held-out questions of ``family`` (another seed than any node's training seed)."""
        return [regenerate(TaskRef(family, 2**62 + 7, index)) for index in range(count)]
