"""One replica: its inner step, its outer state, its evaluation, and its full state for checkpoints.

Inner phase (arXiv 2506.10911, section 3; docs/architecture.md, "The algorithm"): starting from theta = phi, H
steps of Adam without weight decay, gradients clipped at norm 1.0, a learning rate that warms up linearly and then
decays with a cosine to 0.1x the peak. Adam's state is neither reset nor averaged at outer steps; only the weights are.

A :class:`Replica` holds everything one participant owns: the fast weights theta (the model's parameters), the
slow weights phi and outer momentum delta (fp32), the Adam state, the step counters, and its data position. Its
:meth:`Replica.state_dict` is the whole of it, so a checkpoint resumes bit-exactly. The loop that drives it is
training/loop.py; checkpoints and the joiner snapshot are training/checkpoints.py.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from noloco_node.config.models import TrainConfig
from noloco_node.data.corpus import ReplicaShard
from noloco_node.model.decoder import LlamaDecoder, autocast_context, named_parameters_ordered
from noloco_node.model.source import ModelSource
from noloco_node.training.step_plan import StepPlan, plan_without_probe, probe_plan

log = logging.getLogger(__name__)


class MemberRanks(Protocol):
    """The processes of one multi-GPU member (training/data_parallel.py), as a replica uses them."""

    def wrap(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module: ...

    def agree_to_continue(self, stop: bool, device: torch.device) -> bool: ...

    def agree_on_micro_batch(self, micro_batch: int, device: torch.device) -> int: ...


class StepLoss:
    """An inner step's training loss and gradient norm, read without stalling the device.

    On a GPU the step is queued, not finished, when ``train_step`` returns; reading its loss there (``.item()``)
    would wait for everything queued and leave the GPU idle while the next step is queued. Instead the two values
    are copied into pinned host memory behind the step, and ``float(loss)`` waits for that step alone, when
    someone needs the figure (a log line, ``/status``, the phase's mean at its end)."""

    def __init__(self, values: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if values.device.type == "cuda":
            self._host = torch.empty(2, dtype=torch.float32, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = values

    @property
    def done(self) -> bool:
        return self._event is None or self._event.query()

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def __float__(self) -> float:
        self.wait()
        return float(self._host[0])

    @property
    def grad_norm(self) -> float:
        self.wait()
        return float(self._host[1])

    def __repr__(self) -> str:
        return f"StepLoss({float(self):.4f})"


# Inner steps queued ahead of the device at most: the next is queued while the last still runs, so the GPU never
# waits for the host, and no more than that, so that the host's step times stay the device's.
STEPS_IN_FLIGHT = 2


Batch = tuple[torch.Tensor, torch.Tensor]


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """Learning rate of inner step ``step`` (0-based): linear warmup to the peak, then cosine to min_lr_ratio x."""
    warmup = cfg.effective_warmup_steps
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, cfg.total_steps - warmup))
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for but CUDA is not available on this machine")
    return device


class Replica:
    """One model replica: fast weights, inner Adam, outer state (phi, delta) and its data shard(s).

    With one shard, a step trains on one batch of it. With several shards, a step averages the gradients of one
    batch from each: exactly what a gradient all-reduce across that many data-parallel workers computes (the
    simulator's DDP baseline).
    """

    def __init__(
        self,
        source: ModelSource,
        train_cfg: TrainConfig,
        shards: Sequence[ReplicaShard],
        *,
        device: torch.device | None = None,
        data_parallel: MemberRanks | None = None,
    ) -> None:
        if not shards:
            raise ValueError("a replica needs at least one data shard")
        self.source = source
        self.train_cfg = train_cfg
        self.shards = list(shards)
        self.device = device or resolve_device(train_cfg.device)
        # The run's first weights, the same on every replica: drawn from the seed, or read from --init-from's folder.
        self.model = source.initial_model(self.device)
        self.names, self.params = zip(*named_parameters_ordered(self.model), strict=True)
        # Several processes of one member (data_parallel.py): the forward goes through DDP, which averages every
        # inner step's gradients across them. A collective: every rank builds its replica at the same point.
        self.data_parallel = data_parallel
        self.plan = self._plan_step()
        log.info("%s", self.plan.summary())
        self._forward = data_parallel.wrap(self.model, self.device) if data_parallel else self.model
        self.optimizer = torch.optim.Adam(
            self.params,
            lr=learning_rate(0, train_cfg),
            betas=(train_cfg.adam_beta1, train_cfg.adam_beta2),
            eps=train_cfg.adam_eps,
            weight_decay=0.0,
            # One kernel over all parameters on a GPU; a CPU keeps the default (the simulator's figures were made
            # with it).
            fused=True if self.device.type == "cuda" else None,
        )
        self._in_flight: deque[StepLoss] = deque()
        # Outer state in fp32 whatever the training dtype (docs/architecture.md): phi starts as theta, delta at zero.
        # Where the plan put it (training/step_plan.py): on the GPU, where the outer step is a few passes over device
        # memory, or on the host, pinned so that the copies to and from the GPU are asynchronous DMA. The outer step
        # computes where it lives (algorithm.py moves a partner's host tensors there).
        on_gpu = self.device.type == "cuda"
        self.outer_device = self.device if self.plan.outer_state_on_device else torch.device("cpu")
        pinned = on_gpu and self.outer_device.type == "cpu"
        self.phi = [_outer_buffer(p.shape, self.outer_device, pinned).copy_(p.detach()) for p in self.params]
        self.delta = [_outer_buffer(p.shape, self.outer_device, pinned).zero_() for p in self.params]
        # Where theta is gathered on the host at an outer step (the exchange sends it from there).
        self._theta_host = [_outer_buffer(p.shape, torch.device("cpu"), True) for p in self.params] if on_gpu else None
        # Every write to theta moves the version on; the host copy is made again only when it is behind.
        self._theta_version, self._theta_gathered = 0, -1
        self.inner_step = 0
        self.outer_step = 0

    def _plan_step(self) -> StepPlan:
        """The micro-batch, accumulation, compile and checkpointing of this member (training/step_plan.py)."""
        settled = self.train_cfg.micro_batch is not None and self.train_cfg.compile == "off"
        if self.device.type != "cuda" or settled:
            plan = plan_without_probe(
                self.train_cfg,
                self.device,
                compilable=isinstance(self.model, LlamaDecoder),
                parameters=sum(p.numel() for p in self.params),
            )
            if isinstance(self.model, LlamaDecoder):
                self.model.run_blocks(compiled=plan.compiled, checkpointed=plan.checkpointed)
            return plan
        ranks = self.data_parallel

        def agree(micro: int) -> int:
            return ranks.agree_on_micro_batch(micro, self.device) if ranks is not None else micro

        return probe_plan(self.model, self.train_cfg, self.device, optimizer_state_exists=False, agree=agree)

    # ------------------------------------------------------------------------------------------ inner phase

    def train_step(self, *, stop: bool = False) -> StepLoss | None:
        """One inner step; returns its training loss (mean over shards), to be read when needed. In a
        data-parallel member the ranks first agree to take it: None (no step taken, on every rank) once any of
        them asked to ``stop``.

        The step is the run's batch (``batch_size`` sequences of every shard) in micro-batches of the plan's size,
        their gradients accumulated: the mean loss of equal micro-batches is the batch's. Nothing here waits for
        the device except :data:`STEPS_IN_FLIGHT`."""
        if self.data_parallel is not None and not self.data_parallel.agree_to_continue(stop, self.device):
            return None
        while len(self._in_flight) >= STEPS_IN_FLIGHT:
            self._in_flight.popleft().wait()
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(self.inner_step, self.train_cfg)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        micro, count = self.plan.micro_batch, self.plan.accumulation
        parts = count * len(self.shards)
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for shard_index, shard in enumerate(self.shards):
            for part in range(count):
                inputs, targets = self._on_device(shard.next_batch(micro))
                last = shard_index == len(self.shards) - 1 and part == count - 1
                # A data-parallel member all-reduces the gradients once, after the last micro-batch.
                no_sync = getattr(self._forward, "no_sync", None)
                with contextlib.nullcontext() if last or no_sync is None else no_sync():
                    with autocast_context(self.device):
                        loss = self._forward(inputs, targets) / parts
                    loss.backward()
                total += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.train_cfg.grad_clip)
        self.optimizer.step()
        self.inner_step += 1
        self._theta_version += 1
        step_loss = StepLoss(torch.stack([total, grad_norm.detach().float()]))
        self._in_flight.append(step_loss)
        return step_loss

    def _on_device(self, batch: Batch) -> Batch:
        """A host batch on the training device; from pinned memory on a GPU, so the copy overlaps the work queued
        before it (the pinned allocator reuses a buffer only once its copy has completed)."""
        if self.device.type != "cuda":
            return batch
        inputs, targets = batch
        return (
            inputs.pin_memory().to(self.device, non_blocking=True),
            targets.pin_memory().to(self.device, non_blocking=True),
        )

    @property
    def current_lr(self) -> float:
        return learning_rate(max(0, self.inner_step - 1), self.train_cfg)

    # ------------------------------------------------------------------------------------------ outer state

    def weights(self) -> dict[str, list[torch.Tensor]]:
        """theta (fast_weights), phi and delta by part name, as an offer publishes them (pairing/strategy.py)."""
        return {"theta": self.fast_weights(), "phi": list(self.phi), "delta": list(self.delta)}

    def outer_theta(self) -> list[torch.Tensor]:
        """theta where the outer state lives, one tensor per parameter, for the outer step's own maths (the norm
        bound's movement, the blend): views of the live weights when that is the training device (copy before
        training on), else :meth:`fast_weights`."""
        if self.outer_device == self.device:
            return [p.detach() for p in self.params]
        return self.fast_weights()

    def fast_weights(self) -> list[torch.Tensor]:
        """theta on the host, one tensor per parameter, as the exchange sends it. On a CPU: views of the live
        weights (copy before training on). On a GPU: the weights copied into pinned host buffers (reused from one
        outer step to the next)."""
        if self._theta_host is None:
            return [p.detach() for p in self.params]
        if self._theta_gathered != self._theta_version:  # else the host copy is still theta's (one per outer step)
            for host, param in zip(self._theta_host, self.params, strict=True):
                host.copy_(param.detach(), non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()  # the host buffers are complete from here on
            self._theta_gathered = self._theta_version
        return list(self._theta_host)

    @torch.no_grad()
    def apply_outer_step(self, new_phi: Sequence[torch.Tensor], new_delta: Sequence[torch.Tensor]) -> None:
        """Adopt an outer step's result (from algorithm.py) and restart the inner phase from it: theta = phi."""
        if len(new_phi) != len(self.phi) or len(new_delta) != len(self.delta):
            raise ValueError("outer step result does not match this replica's parameters")
        for phi, delta, param, phi_new, delta_new in zip(
            self.phi, self.delta, self.params, new_phi, new_delta, strict=True
        ):
            phi.copy_(phi_new)
            delta.copy_(delta_new)
            # On the GPU a copy within its memory; from pinned host memory an asynchronous DMA. Either way the next
            # inner step is queued behind it on the same stream, and phi is not written again before the next outer
            # step, long after it completed.
            param.copy_(phi, non_blocking=True)
        self.outer_step += 1
        self._theta_version += 1

    # ------------------------------------------------------------------------------------------ joiners

    @torch.no_grad()
    def adopt_donor_weights(self, tensors: dict[str, torch.Tensor], outer_step: int, inner_step: int) -> None:
        """Adopt a donor's slow weights (measured by the caller) and its counters (checked by the caller); rebuild
        the rest here rather than take it on trust. The outer momentum starts again from zero (with alpha = 0.5 it
        halves every outer step anyway), and Adam's moments stay this replica's own: a joiner's are empty, so Adam
        starts afresh with its bias correction, a member's are those of its own recent training. Nothing a donor
        sends but phi (and it is measured) enters the update: moments of 1 and 0 once wrecked every adopter."""
        for name, param, phi, delta in zip(self.names, self.params, self.phi, self.delta, strict=True):
            phi.copy_(tensors[f"phi/{name}"])
            delta.zero_()
            param.copy_(phi)
        self.inner_step = inner_step
        self.outer_step = outer_step
        self._theta_version += 1

    @torch.no_grad()
    def reset_to_seed(self) -> None:
        """Back to the run's first weights and counters, momenta empty: where a fresh joiner whose downloaded
        state went bad starts again (node/catch_up.py)."""
        seed = dict(named_parameters_ordered(self.source.initial_model(torch.device("cpu"))))
        for name, param, phi, delta in zip(self.names, self.params, self.phi, self.delta, strict=True):
            phi.copy_(seed[name])
            param.copy_(phi)
            delta.zero_()
        self.optimizer.state.clear()
        self.inner_step = self.outer_step = 0
        self._theta_version += 1

    def advance_clock(self, outer_step: int) -> None:
        """Move the counters forward to ``outer_step`` and keep the weights: the swarm's clock, rejoined after this
        node was apart from most of its peers (node/outer_step.py). The inner step moves as many whole phases, so
        phases still end at multiples of H; never past the run's last step."""
        if outer_step <= self.outer_step:
            raise ValueError(f"the clock only moves forward: {outer_step} <= {self.outer_step}")
        skipped = (outer_step - self.outer_step) * self.train_cfg.inner_steps
        self.inner_step = min(self.train_cfg.total_steps, self.inner_step + skipped)
        self.outer_step = outer_step

    # ------------------------------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def loss_of(self, weights: Sequence[torch.Tensor], batches: Sequence[Batch]) -> float:
        """The validation loss of other weights (in parameter order), this replica's own put back afterwards: a
        donor's state is measured before it is adopted. Costs one copy of the parameters."""
        own = [p.detach().clone() for p in self.params]
        try:
            for param, weight in zip(self.params, weights, strict=True):
                param.copy_(weight)
            return self.evaluate(batches)
        finally:
            for param, saved in zip(self.params, own, strict=True):
                param.copy_(saved)

    @torch.no_grad()
    def evaluate(self, batches: Sequence[Batch]) -> float:
        """Mean validation loss (nats per token) of the current fast weights over fixed batches."""
        self.model.eval()
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for inputs, targets in batches:
            with autocast_context(self.device):
                total += self.model.loss(inputs.to(self.device), targets.to(self.device))
        return float(total) / len(batches)

    # ------------------------------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The full replica state: theta, phi, delta, Adam, counters, data positions, RNG."""
        return {
            "param_names": list(self.names),
            "theta": [p.detach().cpu().clone() for p in self.params],
            "phi": [t.cpu().clone() for t in self.phi],
            "delta": [t.cpu().clone() for t in self.delta],
            "optimizer": self.optimizer.state_dict(),
            "inner_step": self.inner_step,
            "outer_step": self.outer_step,
            "data_positions": [shard.position for shard in self.shards],
            "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict`; checks every name and shape before changing anything."""
        if list(state["param_names"]) != list(self.names):
            raise ValueError("checkpoint parameter names do not match this model")
        for key in ("theta", "phi", "delta"):
            for name, param, saved in zip(self.names, self.params, state[key], strict=True):
                if saved.shape != param.shape:
                    raise ValueError(
                        f"checkpoint {key} of {name} has shape {tuple(saved.shape)}, model has {tuple(param.shape)}"
                    )
        if len(state["data_positions"]) != len(self.shards):
            raise ValueError("checkpoint was written with a different number of data shards")
        for param, phi, delta, theta_s, phi_s, delta_s in zip(
            self.params, self.phi, self.delta, state["theta"], state["phi"], state["delta"], strict=True
        ):
            param.copy_(theta_s)
            phi.copy_(phi_s)
            delta.copy_(delta_s)
        self.optimizer.load_state_dict(state["optimizer"])
        self._theta_version += 1
        self.inner_step = int(state["inner_step"])
        self.outer_step = int(state["outer_step"])
        for shard, position in zip(self.shards, state["data_positions"], strict=True):
            shard.seek(position)
        torch.set_rng_state(state["rng_cpu"])
        if state["rng_cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng_cuda"])


def _outer_buffer(shape: torch.Size, device: torch.device, pinned: bool) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.float32, device=device, pin_memory=pinned)
