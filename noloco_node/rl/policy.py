"""One node's policy: any causal LM the node can load, sampling G completions per question, the log-probabilities
GRPO needs (algorithm.py), and the supervised warm-up on the task format.

A completion is text: it crosses the swarm decoded, and every node re-tokenizes it with its own tokenizer, so
nodes may run different models (SAPO, arXiv 2509.08721: rollouts are shared as text). It ends at its first newline
or after ``max_new_tokens`` tokens.

Torch runs here, so this is called from the RL trainer thread, never from the event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from noloco_node.algorithm import clipped_surrogate_loss, group_advantages
from noloco_node.data.tokenizer import Tokenizer
from noloco_node.model.decoder import CausalLM, autocast_context
from noloco_node.rl.tasks import Task


@dataclass(frozen=True)
class ScoredGroup:
    """One question's completions with this node's own scores of them (never a sender's)."""

    task: Task
    completions: tuple[str, ...]
    rewards: tuple[float, ...]
    peer_id: str = ""  # who generated them: "" for this node


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return [int(i) for i in np.asarray(tokenizer.encode(text)).reshape(-1)]


class Policy:
    """A causal LM with its tokenizer and optimizer, on one device."""

    def __init__(
        self,
        model: CausalLM,
        tokenizer: Tokenizer,
        device: torch.device,
        *,
        lr: float,
        max_new_tokens: int,
        temperature: float = 1.0,
    ) -> None:
        self.model = model.to(device)
        self.tokenizer = tokenizer
        self.device = device
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)

    # ------------------------------------------------------------------------------------------------ sampling

    @torch.inference_mode()
    def sample(self, prompt: str, count: int, generator: torch.Generator, *, greedy: bool = False) -> list[str]:
        """``count`` completions of ``prompt`` (one batch: the rows share the prompt, so nothing is padded)."""
        self.model.eval()
        prompt_ids = _ids(self.tokenizer, prompt)
        window = self.model.max_seq_len
        rows = torch.tensor([prompt_ids] * count, dtype=torch.long, device=self.device)
        new: list[list[int]] = [[] for _ in range(count)]
        done = [False] * count
        for _ in range(self.max_new_tokens):
            with autocast_context(self.device):
                logits = self.model(rows[:, -window:])[:, -1].float()
            if greedy or self.temperature == 0:
                choice = logits.argmax(dim=-1)
            else:
                probs = torch.softmax(logits / self.temperature, dim=-1).cpu()
                choice = torch.multinomial(probs, 1, generator=generator).squeeze(1).to(self.device)
            rows = torch.cat([rows, choice.unsqueeze(1)], dim=1)
            for row, token in enumerate(choice.tolist()):
                if done[row]:
                    continue
                new[row].append(int(token))
                if "\n" in self.tokenizer.decode(new[row][-4:]):
                    done[row] = True
            if all(done):
                break
        return [self.tokenizer.decode(ids).split("\n", 1)[0] for ids in new]

    # ------------------------------------------------------------------------------------------- log-probs

    def _batch(self, prompts: Sequence[str], completions: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids (right-padded) and a mask over the positions whose next token is a completion token
        (the completion and its closing newline): a causal model's earlier positions never see the padding."""
        sequences: list[list[int]] = []
        masks: list[list[float]] = []
        for prompt, completion in zip(prompts, completions, strict=True):
            head = _ids(self.tokenizer, prompt)
            tail = _ids(self.tokenizer, completion + "\n")
            tokens = (head + tail)[: self.model.max_seq_len + 1]
            sequences.append(tokens)
            masks.append(([0.0] * (len(head) - 1) + [1.0] * len(tail))[: len(tokens) - 1])
        width = max(len(s) for s in sequences)
        ids = torch.zeros(len(sequences), width, dtype=torch.long)
        mask = torch.zeros(len(sequences), width - 1)
        for row, (tokens, row_mask) in enumerate(zip(sequences, masks, strict=True)):
            ids[row, : len(tokens)] = torch.tensor(tokens)
            mask[row, : len(row_mask)] = torch.tensor(row_mask)
        return ids.to(self.device), mask.to(self.device)

    def _token_logprobs(self, ids: torch.Tensor) -> torch.Tensor:
        with autocast_context(self.device):
            logits = self.model(ids[:, :-1]).float()
        return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)

    @torch.inference_mode()
    def answer_nll(self, tasks: Sequence[Task]) -> float:
        """Mean negative log-likelihood per token of the reference answers (and their closing newline): how far the
        policy is from a family's right answers, measurable long before greedy answers come out right."""
        self.model.eval()
        ids, mask = self._batch([t.prompt for t in tasks], [t.answer for t in tasks])
        return float(-(self._token_logprobs(ids) * mask).sum() / mask.sum())

    # ------------------------------------------------------------------------------------------- updates

    def grpo_step(self, groups: Sequence[ScoredGroup], *, steps: int = 1, clip: float = 0.2) -> float:
        """``steps`` gradient steps of GRPO over ``groups`` (local and external alike); returns the last loss."""
        prompts = [g.task.prompt for g in groups for _ in g.completions]
        completions = [c for g in groups for c in g.completions]
        advantages = group_advantages([g.rewards for g in groups])
        ids, mask = self._batch(prompts, completions)
        advantages = advantages.to(self.device)
        self.model.train()
        with torch.no_grad():
            old = self._token_logprobs(ids)
        loss = torch.zeros(())
        for _ in range(steps):
            loss = clipped_surrogate_loss(self._token_logprobs(ids), old, advantages, mask, clip=clip)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
        return float(loss.detach())

    def supervised_step(self, tasks: Sequence[Task]) -> float:
        """One step of next-token loss on the reference answers' tokens only: the warm-up on the task format that
        makes a small model's first rewards not all zero."""
        ids, mask = self._batch([t.prompt for t in tasks], [t.answer for t in tasks])
        self.model.train()
        loss = -(self._token_logprobs(ids) * mask).sum() / mask.sum()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        return float(loss.detach())
