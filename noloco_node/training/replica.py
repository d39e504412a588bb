"""One replica: its inner step, its outer state, its evaluation, and its full state for checkpoints.

Inner phase (arXiv 2506.10911, section 3; docs/architecture.md, "The algorithm"): starting from theta = phi, H
steps of Adam without weight decay, gradients clipped at norm 1.0, a learning rate that warms up linearly and then
decays with a cosine to 0.1x the peak. Adam's state is neither reset nor averaged at outer steps; only the weights are.

A :class:`Replica` holds everything one participant owns: the fast weights theta (the model's parameters), the
slow weights phi and outer momentum delta (fp32), the Adam state, the step counters, and its data position. Its
:meth:`Replica.state_dict` is the whole of it, so a checkpoint resumes bit-exactly. The loop that drives it is
training/loop.py; checkpoints and the joiner snapshot are training/checkpoints.py.

In a member of several ranks (training/data_parallel.py) each rank's replica holds its shards of the weights and of
Adam's moments; rank 0's alone holds the outer state, whole, on the host. Every method that reads or writes the
whole model (the outer step's, the evaluations', the state's) is then a collective: on rank 0 it names itself to
the other ranks first, which take their part in it from :meth:`Replica.follow`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch

from noloco_node.config.models import TrainConfig
from noloco_node.data.corpus import ReplicaShard
from noloco_node.model.decoder import LlamaDecoder, autocast_context, named_parameters_ordered
from noloco_node.model.source import ModelSource
from noloco_node.training.sharded_tensors import gather_whole, is_sharded, local_part, scatter_whole
from noloco_node.training.step_plan import PlanError, StepPlan, plan_for_memory, plan_without_probe, probe_plan

log = logging.getLogger(__name__)


class MemberRanks(Protocol):
    """The processes of one multi-GPU member (training/data_parallel.py), as a replica uses them."""

    rank: int
    world_size: int

    @property
    def leader(self) -> bool: ...

    def wrap(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module: ...

    def agree_to_continue(self, stop: bool, device: torch.device) -> bool: ...

    def agree_on_micro_batch(self, micro_batch: int, device: torch.device) -> int: ...

    def announce(self, call: str, args: tuple[Any, ...] = ()) -> None: ...

    def receive(self) -> tuple[str, tuple[Any, ...]]: ...


# What rank 0 of a sharded member may have the other ranks take part in (Replica.follow): the methods that read or
# write the whole model. "train" and "leave" end the following.
FOLLOWED_CALLS = frozenset(
    {
        "fast_weights",
        "apply_outer_step",
        "loss_of",
        "evaluate",
        "adopt_donor_weights",
        "reset_to_seed",
        "state_dict",
        "load_state_dict",
        "adam_moments",
        "report_stopped",
    }
)


class MemberRanksError(RuntimeError):
    """A whole-model call of rank 0 while the other ranks of its member train: it would hang in a collective."""


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
        # Several processes of one member (data_parallel.py): the model is sharded across them, and their gradients
        # averaged at every inner step. A collective: every rank builds its replica at the same point.
        self.data_parallel = data_parallel
        self.sharded = data_parallel is not None
        self.leader = data_parallel is None or data_parallel.leader
        self.plan = self._plan_step(sum(p.numel() for _, p in named_parameters_ordered(self.model)))
        log.info("%s", self.plan.summary())
        if data_parallel is not None:
            data_parallel.wrap(self.model, self.device)  # from here on the parameters are this rank's shards
        self.names, self.params = zip(*named_parameters_ordered(self.model), strict=True)
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
        # computes where it lives (algorithm.py moves a partner's host tensors there). A sharded member keeps it
        # whole on rank 0's host, where the exchange and the outer step need it; its other ranks keep none.
        on_gpu = self.device.type == "cuda"
        on_device = self.plan.outer_state_on_device and not self.sharded
        self.outer_device = self.device if on_device else torch.device("cpu")
        pinned = on_gpu and self.outer_device.type == "cpu"
        keeps_outer_state = self.leader
        self.phi = [_outer_buffer(p.shape, self.outer_device, pinned) for p in self.params] if keeps_outer_state else []
        self.delta = [_outer_buffer(p.shape, self.outer_device, pinned).zero_() for p in self.phi]
        # Where theta is gathered on the host at an outer step (the exchange sends it from there).
        self._theta_host = (
            [_outer_buffer(p.shape, torch.device("cpu"), on_gpu) for p in self.params]
            if keeps_outer_state and (on_gpu or self.sharded)
            else None
        )
        if self.sharded:
            gather_whole(self.params, self.phi or None)  # every rank, at the same point
        else:
            for phi, param in zip(self.phi, self.params, strict=True):
                phi.copy_(param.detach())
        # Every write to theta moves the version on; the host copy is made again only when it is behind.
        self._theta_version, self._theta_gathered = 0, -1
        self.inner_step = 0
        self.outer_step = 0
        # Rank 0 of a sharded member: whether the other ranks wait in follow() (from the start until the first
        # phase, between two phases, after the last), and how deep in a whole-model call this rank is.
        self._followers_waiting = True
        self._call_depth = 0

    def _plan_step(self, parameters: int) -> StepPlan:
        """The micro-batch, accumulation, compile and checkpointing of this member (training/step_plan.py)."""
        settled = self.train_cfg.micro_batch is not None and self.train_cfg.compile == "off"
        ranks = self.data_parallel
        if self.device.type == "cuda" and ranks is not None and isinstance(self.model, LlamaDecoder):
            # The shards' memory by the model: a probe's passes would be collectives, and one rank out of memory
            # while the others are not would leave them waiting in one.
            _free, total = torch.cuda.mem_get_info(self.device)
            plan = plan_for_memory(self.model.config, self.train_cfg, total, ranks=ranks.world_size)
            if plan.micro_batch == 0:
                raise PlanError(f"sharded over {ranks.world_size} GPUs: " + "; ".join(plan.notes))
            plan.device = f"{self.device} ({torch.cuda.get_device_name(self.device)})"
            plan.outer_state_on_device = False
            plan.micro_batch = ranks.agree_on_micro_batch(max(1, plan.micro_batch), self.device)
            self.model.run_blocks(compiled=plan.compiled, checkpointed=plan.checkpointed)
            return plan
        if self.device.type != "cuda" or settled:
            plan = plan_without_probe(
                self.train_cfg,
                self.device,
                compilable=isinstance(self.model, LlamaDecoder),
                parameters=parameters,
            )
            if isinstance(self.model, LlamaDecoder):
                self.model.run_blocks(compiled=plan.compiled, checkpointed=plan.checkpointed)
            return plan

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
                if self.sharded:  # the ranks reduce-scatter the gradients once, after the last micro-batch
                    self.model.set_requires_gradient_sync(last)  # type: ignore[operator]
                with autocast_context(self.device):
                    loss = self.model(inputs, targets) / parts
                loss.backward()
                total += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.train_cfg.grad_clip)
        if is_sharded(grad_norm):  # the norm over every rank's shards
            grad_norm = grad_norm.full_tensor()  # type: ignore[attr-defined]
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

    # ------------------------------------------------------------------------------------------ the member's ranks

    @contextlib.contextmanager
    def _whole_model(self, call: str, *follower_args: Any) -> Iterator[None]:
        """A call that reads or writes the whole model. On rank 0 of a sharded member the other ranks are told to
        take part first (they call the same method with ``follower_args``); nested calls are part of the outer
        one. Elsewhere nothing to do."""
        if self.sharded and self.leader and self._call_depth == 0:
            if not self._followers_waiting:
                raise MemberRanksError(f"{call}: the other ranks of this member are training, not following")
            assert self.data_parallel is not None
            self.data_parallel.announce(call, follower_args)
        self._call_depth += 1
        try:
            yield
        finally:
            self._call_depth -= 1

    def follow(self) -> bool:
        """Another rank of a sharded member, whenever it is not training: take part in rank 0's whole-model calls
        until rank 0 lets the ranks train (True, with its counters) or leaves (False)."""
        assert self.data_parallel is not None and not self.leader
        while True:
            call, args = self.data_parallel.receive()
            if call == "leave":
                return False
            if call == "train":
                inner_step, outer_step, position = args
                self.inner_step, self.outer_step = inner_step, outer_step
                if position is not None:  # at the start: each rank's slice has its own length, the same place in it
                    for shard in self.shards:
                        shard.seek({"epoch": position["epoch"], "cursor": min(position["cursor"], shard.num_windows)})
                return True
            if call not in FOLLOWED_CALLS:
                raise MemberRanksError(f"rank 0 asked for {call!r}, which is no whole-model call")
            getattr(self, call)(*args)

    def release_followers(self, *, train: bool, first: bool = False) -> None:
        """Rank 0 of a sharded member: let the other ranks train the next phase (``train``; ``first`` at the start,
        when they also take this rank's data position) or leave. Nothing to do elsewhere."""
        if not (self.sharded and self.leader) or not self._followers_waiting:
            return
        assert self.data_parallel is not None
        if train:
            position = self.shards[0].position if first else None
            self.data_parallel.announce("train", (self.inner_step, self.outer_step, position))
        else:
            self.data_parallel.announce("leave")
        self._followers_waiting = False

    def followers_wait(self) -> None:
        """Rank 0 of a sharded member: the other ranks have ended a phase (or the run) and wait in follow()."""
        self._followers_waiting = True

    # ------------------------------------------------------------------------------------------ outer state

    def weights(self) -> dict[str, list[torch.Tensor]]:
        """theta (fast_weights), phi and delta by part name, as an offer publishes them (pairing/strategy.py)."""
        return {"theta": self.fast_weights(), "phi": list(self.phi), "delta": list(self.delta)}

    def outer_theta(self) -> list[torch.Tensor]:
        """theta where the outer state lives, one tensor per parameter, for the outer step's own maths (the norm
        bound's movement, the blend): views of the live weights when that is the training device (copy before
        training on), else :meth:`fast_weights`."""
        if self.outer_device == self.device and not self.sharded:
            return [p.detach() for p in self.params]
        return self.fast_weights()

    def fast_weights(self) -> list[torch.Tensor]:
        """theta on the host, one tensor per parameter, as the exchange sends it. On a CPU: views of the live
        weights (copy before training on). On a GPU, and in a sharded member: the weights copied (gathered) into
        host buffers reused from one outer step to the next."""
        if self._theta_host is None and not self.sharded:
            return [p.detach() for p in self.params]
        if self.leader and self._theta_gathered == self._theta_version:  # the host copy is still theta's
            assert self._theta_host is not None
            return list(self._theta_host)
        with self._whole_model("fast_weights"):
            self._gather_theta()
        return list(self._theta_host or [])

    def _gather_theta(self) -> None:
        """theta into the host buffers (every rank of a sharded member takes part; rank 0 keeps it)."""
        if self.sharded:
            gather_whole(self.params, self._theta_host)
        else:
            assert self._theta_host is not None
            for host, param in zip(self._theta_host, self.params, strict=True):
                host.copy_(param.detach(), non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the host buffers are complete from here on
        self._theta_gathered = self._theta_version

    @torch.no_grad()
    def apply_outer_step(
        self, new_phi: Sequence[torch.Tensor] | None, new_delta: Sequence[torch.Tensor] | None
    ) -> None:
        """Adopt an outer step's result (from algorithm.py) and restart the inner phase from it: theta = phi.
        (None on the other ranks of a sharded member: they take their shards of rank 0's.)"""
        with self._whole_model("apply_outer_step", None, None):
            if self.leader:
                assert new_phi is not None and new_delta is not None
                if len(new_phi) != len(self.phi) or len(new_delta) != len(self.delta):
                    raise ValueError("outer step result does not match this replica's parameters")
                for phi, delta, phi_new, delta_new in zip(self.phi, self.delta, new_phi, new_delta, strict=True):
                    phi.copy_(phi_new)
                    delta.copy_(delta_new)
            self._write_theta(self.phi if self.leader else None)
            self.outer_step += 1

    def _write_theta(self, whole: Sequence[torch.Tensor] | None) -> None:
        """theta = ``whole`` (rank 0's, in parameter order). On the GPU a copy within its memory; from pinned host
        memory an asynchronous DMA. Either way the next inner step is queued behind it on the same stream, and the
        source is not written again before the next outer step, long after it completed."""
        if self.sharded:
            scatter_whole(self.params, whole)
        else:
            assert whole is not None
            for param, source in zip(self.params, whole, strict=True):
                param.detach().copy_(source, non_blocking=True)
        self._theta_version += 1

    # ------------------------------------------------------------------------------------------ joiners

    @torch.no_grad()
    def adopt_donor_weights(self, tensors: dict[str, torch.Tensor] | None, outer_step: int, inner_step: int) -> None:
        """Adopt a donor's slow weights (measured by the caller) and its counters (checked by the caller); rebuild
        the rest here rather than take it on trust. The outer momentum starts again from zero (with alpha = 0.5 it
        halves every outer step anyway), and Adam's moments stay this replica's own: a joiner's are empty, so Adam
        starts afresh with its bias correction, a member's are those of its own recent training. Nothing a donor
        sends but phi (and it is measured) enters the update: moments of 1 and 0 once wrecked every adopter."""
        with self._whole_model("adopt_donor_weights", None, outer_step, inner_step):
            if self.leader:
                assert tensors is not None
                for name, phi, delta in zip(self.names, self.phi, self.delta, strict=True):
                    phi.copy_(tensors[f"phi/{name}"])
                    delta.zero_()
            self._write_theta(self.phi if self.leader else None)
            self.inner_step = inner_step
            self.outer_step = outer_step

    @torch.no_grad()
    def reset_to_seed(self) -> None:
        """Back to the run's first weights and counters, momenta empty: where a fresh joiner whose downloaded
        state went bad starts again (node/catch_up.py)."""
        with self._whole_model("reset_to_seed"):
            if self.leader:
                seed = dict(named_parameters_ordered(self.source.initial_model(torch.device("cpu"))))
                for name, phi, delta in zip(self.names, self.phi, self.delta, strict=True):
                    phi.copy_(seed[name])
                    delta.zero_()
            self._write_theta(self.phi if self.leader else None)
            self.optimizer.state.clear()
            self.inner_step = self.outer_step = 0

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
    def loss_of(self, weights: Sequence[torch.Tensor] | None, batches: Sequence[Batch]) -> float:
        """The validation loss of other weights (in parameter order), this replica's own put back afterwards: a
        donor's state is measured before it is adopted. Costs one copy of the parameters (of this rank's shards)."""
        with self._whole_model("loss_of", None, list(batches)):
            own = [local_part(p.detach()).clone() for p in self.params]
            version = self._theta_version  # theta is put back as it was: a host copy of it stays good
            try:
                self._write_theta(weights)
                return self.evaluate(batches)
            finally:
                for param, saved in zip(self.params, own, strict=True):
                    local_part(param.detach()).copy_(saved)
                self._theta_version = version

    @torch.no_grad()
    def evaluate(self, batches: Sequence[Batch]) -> float:
        """Mean validation loss (nats per token) of the current fast weights over fixed batches."""
        with self._whole_model("evaluate", list(batches)):
            self.model.eval()
            total = torch.zeros((), dtype=torch.float32, device=self.device)
            try:
                for inputs, targets in batches:
                    with autocast_context(self.device):
                        total += self.model.loss(inputs.to(self.device), targets.to(self.device))
            finally:
                if self.sharded:
                    # A forward without a backward leaves the root's weights gathered whole (FSDP2 frees them after
                    # the backward): freed here, the next forward gathers the shards as they are by then.
                    self.model.reshard()  # type: ignore[operator]
            return float(total) / len(batches)

    def report_stopped(self) -> None:
        """Every rank of a member, as it leaves: its step and a short digest of the whole weights' bytes, which
        every rank gathers (the ranks of one member print the same line)."""
        with self._whole_model("report_stopped"):
            digest = hashlib.sha256()
            for param in self.params:
                whole = param.detach().full_tensor() if is_sharded(param) else param.detach()
                digest.update(whole.cpu().contiguous().numpy().tobytes())
            rank, ranks = (self.data_parallel.rank, self.data_parallel.world_size) if self.data_parallel else (0, 1)
            log.info(
                "rank %d of %d stopped at inner step %d, weights digest %s",
                rank,
                ranks,
                self.inner_step,
                digest.hexdigest()[:16],
            )

    # ------------------------------------------------------------------------------------------ state

    def adam_moments(self) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None], list[float | None]]:
        """Adam's two moments, whole, and its step count, per parameter (None where Adam has no state yet). The live
        tensors in one process; in a sharded member gathered into new host tensors on rank 0 (the other ranks,
        taking part, get None)."""
        with self._whole_model("adam_moments"):
            states = [self.optimizer.state.get(param, {}) for param in self.params]
            steps = [float(state["step"]) if "step" in state else None for state in states]
            moments: dict[str, list[torch.Tensor | None]] = {"exp_avg": [], "exp_avg_sq": []}
            for param, state in zip(self.params, states, strict=True):
                for moment, tensors in moments.items():
                    value = state.get(moment)
                    if value is None or not is_sharded(value):
                        tensors.append(value)
                        continue
                    whole = torch.empty(param.shape, dtype=torch.float32) if self.leader else None
                    gather_whole([value], [whole] if whole is not None else None)
                    tensors.append(whole)
            return moments["exp_avg"], moments["exp_avg_sq"], steps

    def state_dict(self) -> dict[str, Any]:
        """The full replica state: theta, phi, delta, Adam, counters, data positions, RNG."""
        theta = None
        with self._whole_model("state_dict"):
            exp_avg, exp_avg_sq, steps = self.adam_moments()
            if self.sharded:
                self._gather_theta()
                theta = [t.clone() for t in self._theta_host or []]
        if self.sharded:
            optimizer: dict[str, Any] = {
                "state": {
                    index: {"step": torch.tensor(step), "exp_avg": exp_avg[index], "exp_avg_sq": exp_avg_sq[index]}
                    for index, step in enumerate(steps)
                    if step is not None
                },
                "param_groups": self.optimizer.state_dict()["param_groups"],
            }
        else:
            optimizer = self.optimizer.state_dict()
        return {
            "param_names": list(self.names),
            "theta": theta if theta is not None else [p.detach().cpu().clone() for p in self.params],
            "phi": [t.cpu().clone() for t in self.phi],
            "delta": [t.cpu().clone() for t in self.delta],
            "optimizer": optimizer,
            "inner_step": self.inner_step,
            "outer_step": self.outer_step,
            "data_positions": [shard.position for shard in self.shards],
            "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict`; checks every name and shape before changing anything. (The other
        ranks of a sharded member get its counters and Adam's step counts, and take their shards of the rest.)"""
        if self.leader:
            self._check_state(state)
        steps = _adam_steps(state["optimizer"], len(self.params)) if self.leader else state["adam_steps"]
        counters = {"inner_step": int(state["inner_step"]), "outer_step": int(state["outer_step"])}
        with self._whole_model("load_state_dict", {"adam_steps": steps, **counters}):
            if self.leader:
                for phi, delta, phi_s, delta_s in zip(self.phi, self.delta, state["phi"], state["delta"], strict=True):
                    phi.copy_(phi_s)
                    delta.copy_(delta_s)
            if not self.sharded:
                self._write_theta(state["theta"])
                self.optimizer.load_state_dict(state["optimizer"])
            else:
                self._write_theta(state["theta"] if self.leader else None)
                self._load_sharded_moments(steps, state["optimizer"]["state"] if self.leader else None)
            self.inner_step, self.outer_step = counters["inner_step"], counters["outer_step"]
        if self.leader:
            for shard, position in zip(self.shards, state["data_positions"], strict=True):
                shard.seek(position)
            torch.set_rng_state(state["rng_cpu"])
            if state["rng_cuda"] and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(state["rng_cuda"])

    def _check_state(self, state: dict[str, Any]) -> None:
        if list(state["param_names"]) != list(self.names):
            raise ValueError("checkpoint parameter names do not match this model")
        for key in ("theta", "phi", "delta"):
            for name, param, saved in zip(self.names, self.params, state[key], strict=True):
                if tuple(saved.shape) != tuple(param.shape):
                    raise ValueError(
                        f"checkpoint {key} of {name} has shape {tuple(saved.shape)}, model has {tuple(param.shape)}"
                    )
        if len(state["data_positions"]) != len(self.shards):
            raise ValueError("checkpoint was written with a different number of data shards")

    def _load_sharded_moments(
        self, steps: list[float | None], whole: dict[int, dict[str, torch.Tensor]] | None
    ) -> None:
        """Every rank of a sharded member: Adam's state from rank 0's whole moments (``whole``, by parameter index)."""
        self.optimizer.state.clear()
        for index, (param, step) in enumerate(zip(self.params, steps, strict=True)):
            if step is None:
                continue
            state = {"step": torch.tensor(step)}
            for moment in ("exp_avg", "exp_avg_sq"):
                state[moment] = torch.zeros_like(param.detach(), dtype=torch.float32)
                scatter_whole([state[moment]], [whole[index][moment]] if whole is not None else None)
            self.optimizer.state[param] = state


def _adam_steps(optimizer_state: dict[str, Any], count: int) -> list[float | None]:
    """Adam's step count per parameter index in an optimizer state dict (None where it holds no state)."""
    states = optimizer_state["state"]
    return [float(states[index]["step"]) if index in states else None for index in range(count)]


def _outer_buffer(shape: torch.Size, device: torch.device, pinned: bool) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.float32, device=device, pin_memory=pinned)
