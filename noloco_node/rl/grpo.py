"""GRPO, the policy update SAPO uses (arXiv 2509.08721, eq. 2; GRPO from DeepSeekMath, arXiv 2402.03300, eq. 3),
without the KL term (SAPO's setting, and this project's default).

For a group of G completions o_1..o_G of one question q with rewards r_1..r_G, every token of o_i gets the
group-normalised advantage

    A_i = (r_i − mean(r)) / (std(r) + ε)

and the loss is the clipped surrogate, averaged over each completion's tokens and then over completions:

    L = − mean_i  (1/|o_i|) Σ_t  min( ρ_{i,t} A_i,  clip(ρ_{i,t}, 1 − ε_clip, 1 + ε_clip) A_i ),
    ρ_{i,t} = π_θ(o_{i,t} | q, o_{i,<t}) / π_old(o_{i,t} | q, o_{i,<t})

π_old is the policy as it was when the update began (its log-probabilities computed once, detached), so with one
gradient step per round ρ = 1 and the update is the plain group-normalised policy gradient; the clip matters from
the second step of a round on. External rollouts are treated as on-policy, as the paper does: their π_old is this
node's own policy at the start of the update, not the sender's (docs/rl.md, "Off-policy").

A group whose completions all scored the same has advantage 0 everywhere and teaches nothing; it still counts in
the mean over completions, as in GRPO.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

ADVANTAGE_EPSILON = 1e-4


def group_advantages(groups: Sequence[Sequence[float]]) -> torch.Tensor:
    """Each group's rewards -> one advantage per completion, normalised within its group (unbiased std, as GRPO),
    concatenated in order. Groups may differ in size: a peer may sample another G."""
    advantages = []
    for rewards in groups:
        if len(rewards) < 2:
            raise ValueError(f"a group needs at least 2 completions to normalise within, not {len(rewards)}")
        values = torch.tensor(rewards, dtype=torch.float32)
        advantages.append((values - values.mean()) / (values.std() + ADVANTAGE_EPSILON))
    return torch.cat(advantages) if advantages else torch.zeros(0)


def clipped_surrogate_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float = 0.2,
) -> torch.Tensor:
    """The GRPO loss over completions: ``logprobs``, ``old_logprobs`` and ``mask`` are (completions, tokens),
    ``advantages`` is (completions,). Tokens where ``mask`` is 0 (padding) count for nothing."""
    ratio = torch.exp(logprobs - old_logprobs)
    advantage = advantages.unsqueeze(1)
    surrogate = torch.minimum(ratio * advantage, torch.clamp(ratio, 1.0 - clip, 1.0 + clip) * advantage)
    lengths = mask.sum(dim=1).clamp(min=1.0)
    per_completion = (surrogate * mask).sum(dim=1) / lengths
    return -per_completion.mean()
