"""GRPO (algorithm.py, rl/policy.py): group-normalised advantages, the clipped surrogate, and what one update does to
a real model: more probability for a rewarded completion, none moved by a group whose completions all scored the
same (a liar's wrong answers, scored 0 by the receiver)."""

from __future__ import annotations

import pytest
import torch

from noloco_node.algorithm import clipped_surrogate_loss, group_advantages
from noloco_node.config.models import model_config_for
from noloco_node.data.tokenizer import ByteTokenizer
from noloco_node.model.source import SeededDecoder
from noloco_node.rl.policy import Policy, ScoredGroup
from noloco_node.rl.tasks import TaskRef, regenerate


def test_advantages_are_normalised_within_each_group_of_any_size():
    advantages = group_advantages([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5], [0.0, 1.0, 0.0]])
    assert advantages.shape == (9,)
    first, second, third = advantages[:4], advantages[4:6], advantages[6:]
    assert first.mean().abs() < 1e-6 and abs(float(first.std()) - 1.0) < 1e-3
    assert torch.equal(second, torch.zeros(2))  # all equal: nothing to learn
    assert third[1] > 0 > third[0]
    with pytest.raises(ValueError, match="at least 2"):
        group_advantages([[1.0]])


def test_the_surrogate_is_clipped_and_ignores_padding():
    old = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    advantages = torch.tensor([1.0, -1.0])
    # At ratio 1 the loss is minus the mean advantage (0 here), whatever the padding holds.
    assert float(clipped_surrogate_loss(old, old, advantages, mask)) == pytest.approx(0.0)
    # A ratio far above 1 + clip earns a positive advantage no more than 1 + clip.
    far = torch.full((2, 3), 2.0)
    loss = clipped_surrogate_loss(far, old, torch.tensor([1.0, 1.0]), mask, clip=0.2)
    assert float(loss) == pytest.approx(-1.2)


def _policy() -> Policy:
    torch.manual_seed(0)
    cfg = model_config_for("tiny", vocab_size=256, max_seq_len=128)
    model = SeededDecoder(cfg, seed=0, size="tiny").initial_model(torch.device("cpu"))
    return Policy(model, ByteTokenizer(), torch.device("cpu"), lr=1e-2, max_new_tokens=4)


def _completion_logprob(policy: Policy, prompt: str, completion: str) -> float:
    ids, mask = policy._batch([prompt], [completion])
    with torch.no_grad():
        return float((policy._token_logprobs(ids) * mask).sum())


def test_an_update_raises_the_rewarded_completion_and_a_zero_advantage_group_moves_nothing():
    task = regenerate(TaskRef("chain_sum", 5, 17))
    policy = _policy()
    good, bad = task.answer, "zz"
    before = _completion_logprob(policy, task.prompt, good)
    policy.grpo_step([ScoredGroup(task, (good, bad, bad, good), (1.0, 0.0, 0.0, 1.0))])
    assert _completion_logprob(policy, task.prompt, good) > before

    fresh = _policy()
    weights = [p.detach().clone() for p in fresh.model.parameters()]
    lies = ScoredGroup(task, (f"{task.answer}9",) * 4, (0.0, 0.0, 0.0, 0.0))
    fresh.grpo_step([lies])
    assert all(torch.equal(w, p) for w, p in zip(weights, fresh.model.parameters(), strict=True))
