"""The inner loop of one replica, its evaluation, and atomic checkpoints of its full state.

Inner phase (arXiv 2506.10911, section 3 / DESIGN.md): starting from theta = phi, H steps of Adam without weight
decay, gradients clipped at norm 1.0, a learning rate that warms up linearly and then decays with a cosine to
0.1x the peak. Adam's state is neither reset nor averaged at outer steps; only the weights are.

A :class:`Replica` holds everything one participant owns: the fast weights theta (the model's parameters), the
slow weights phi and outer momentum delta (fp32), the Adam state, the step counters, and its data position. Its
:meth:`Replica.state_dict` is the whole of it, so a checkpoint resumes bit-exactly.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from noloco_node import algorithm
from noloco_node.config.models import DataConfig, ModelConfig, OuterConfig, TrainConfig, model_config_for
from noloco_node.data.corpus import ReplicaShard, load_corpus, validation_batches
from noloco_node.model.decoder import LlamaDecoder, autocast_context, named_parameters_ordered, token_loss
from noloco_node.training.data_parallel import DataParallel

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 1
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


def build_model(model_cfg: ModelConfig, *, seed: int, device: torch.device) -> LlamaDecoder:
    """The run's initial weights: a function of the seed only, so every replica of a run starts identical."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaDecoder(model_cfg)
    return model.to(device)


class Replica:
    """One model replica: fast weights, inner Adam, outer state (phi, delta) and its data shard(s).

    With one shard, a step trains on one batch of it. With several shards, a step averages the gradients of one
    batch from each: exactly what a gradient all-reduce across that many data-parallel workers computes (the
    simulator's DDP baseline).
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        train_cfg: TrainConfig,
        shards: Sequence[ReplicaShard],
        *,
        device: torch.device | None = None,
        data_parallel: DataParallel | None = None,
    ) -> None:
        if not shards:
            raise ValueError("a replica needs at least one data shard")
        self.model_cfg = model_cfg
        self.train_cfg = train_cfg
        self.shards = list(shards)
        self.device = device or resolve_device(train_cfg.device)
        self.model = build_model(model_cfg, seed=train_cfg.seed, device=self.device)
        self.names, self.params = zip(*named_parameters_ordered(self.model), strict=True)
        # Several processes of one member (data_parallel.py): the forward goes through DDP, which averages every
        # inner step's gradients across them. A collective: every rank builds its replica at the same point.
        self.data_parallel = data_parallel
        self._forward = data_parallel.wrap(self.model, self.device) if data_parallel else self.model
        self.optimizer = torch.optim.Adam(
            self.params,
            lr=learning_rate(0, train_cfg),
            betas=(train_cfg.adam_beta1, train_cfg.adam_beta2),
            eps=train_cfg.adam_eps,
            weight_decay=0.0,
        )
        # Outer state in fp32 whatever the training dtype (DESIGN.md): phi starts equal to theta, delta at zero. It
        # lives on the host whatever the training device: on a GPU it would take two more model copies of GPU
        # memory, and the outer step, the exchange and the donor snapshot all work on the host. Pinned on a CUDA
        # machine, so that the copies to and from the GPU are asynchronous DMA.
        pinned = self.device.type == "cuda"
        self.phi = [_host_buffer(p.shape, pinned).copy_(p.detach()) for p in self.params]
        self.delta = [_host_buffer(p.shape, pinned).zero_() for p in self.params]
        # Where theta is gathered on the host at an outer step (the exchange sends it, the blend reads it).
        self._theta_host = [_host_buffer(p.shape, pinned) for p in self.params] if pinned else None
        self.inner_step = 0
        self.outer_step = 0
        self.last_grad_norm = 0.0

    # ------------------------------------------------------------------------------------------ inner phase

    def train_step(self, *, stop: bool = False) -> float | None:
        """One inner step; returns the training loss (mean over shards). In a data-parallel member the ranks first
        agree to take it: None (no step taken, on every rank) once any of them asked to ``stop``."""
        if self.data_parallel is not None and not self.data_parallel.agree_to_continue(stop, self.device):
            return None
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(self.inner_step, self.train_cfg)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for shard in self.shards:
            inputs, targets = shard.next_batch(self.train_cfg.batch_size)
            with autocast_context(self.device):
                logits = self._forward(inputs.to(self.device))
                loss = token_loss(logits, targets.to(self.device)) / len(self.shards)
            loss.backward()
            total += loss.item()
        self.last_grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.train_cfg.grad_clip))
        self.optimizer.step()
        self.inner_step += 1
        return total

    def train_phase(self, steps: int) -> list[float]:
        losses = [self.train_step() for _ in range(steps)]
        return [loss for loss in losses if loss is not None]

    @property
    def current_lr(self) -> float:
        return learning_rate(max(0, self.inner_step - 1), self.train_cfg)

    # ------------------------------------------------------------------------------------------ outer state

    def fast_weights(self) -> list[torch.Tensor]:
        """theta on the host, one tensor per parameter. On a CPU: views of the live weights (copy before training
        on). On a GPU: the weights copied into pinned host buffers (reused from one outer step to the next)."""
        if self._theta_host is None:
            return [p.detach() for p in self.params]
        for host, param in zip(self._theta_host, self.params, strict=True):
            host.copy_(param.detach(), non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()  # the host buffers are complete from here on
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
            # From pinned memory this is an asynchronous DMA; the next inner step is queued behind it on the same
            # stream, and phi is not written again before the next outer step, long after it completed.
            param.copy_(phi, non_blocking=True)
        self.outer_step += 1

    # ------------------------------------------------------------------------------------------ donor snapshot

    @torch.no_grad()
    def outer_snapshot(self) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
        """A copy of the state a joiner needs, taken at an outer step (theta == phi there): phi, delta, Adam's
        moments, and the counters. Copies, so that serving it never blocks or races this replica's training."""
        named: list[tuple[str, torch.Tensor]] = []
        for prefix, tensors in (("phi", self.phi), ("delta", self.delta)):
            named += [
                (f"{prefix}/{name}", t.detach().cpu().clone()) for name, t in zip(self.names, tensors, strict=True)
            ]
        adam_step = 0
        for moment in ("exp_avg", "exp_avg_sq"):
            for name, param in zip(self.names, self.params, strict=True):
                state = self.optimizer.state.get(param, {})
                value = state.get(moment)
                named.append(
                    (
                        f"adam.{moment}/{name}",
                        value.detach().cpu().clone() if value is not None else torch.zeros(param.shape),
                    )
                )
                if "step" in state:
                    adam_step = int(state["step"])
        metadata = {"inner_step": self.inner_step, "outer_step": self.outer_step, "adam_step": adam_step}
        return named, metadata

    def snapshot_layout(self) -> list[tuple[str, tuple[int, ...]]]:
        return snapshot_layout(self.model_cfg)

    @torch.no_grad()
    def load_outer_snapshot(self, tensors: dict[str, torch.Tensor], metadata: dict[str, Any]) -> None:
        """Adopt a donor's snapshot (already verified by wire.py): weights, outer state, Adam moments, counters."""
        for name, param, phi, delta in zip(self.names, self.params, self.phi, self.delta, strict=True):
            phi.copy_(tensors[f"phi/{name}"])
            delta.copy_(tensors[f"delta/{name}"])
            param.copy_(phi)
            adam_step = int(metadata["adam_step"])
            if adam_step > 0:
                self.optimizer.state[param] = {
                    "step": torch.tensor(float(adam_step)),
                    "exp_avg": tensors[f"adam.exp_avg/{name}"].to(param.device, torch.float32).clone(),
                    "exp_avg_sq": tensors[f"adam.exp_avg_sq/{name}"].to(param.device, torch.float32).clone(),
                }
        self.inner_step = int(metadata["inner_step"])
        self.outer_step = int(metadata["outer_step"])

    # ------------------------------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self, batches: Sequence[Batch]) -> float:
        """Mean validation loss (nats per token) of the current fast weights over fixed batches."""
        self.model.eval()
        losses = []
        for inputs, targets in batches:
            with autocast_context(self.device):
                losses.append(self.model.loss(inputs.to(self.device), targets.to(self.device)).item())
        return sum(losses) / len(losses)

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
        self.inner_step = int(state["inner_step"])
        self.outer_step = int(state["outer_step"])
        for shard, position in zip(self.shards, state["data_positions"], strict=True):
            shard.seek(position)
        torch.set_rng_state(state["rng_cpu"])
        if state["rng_cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng_cuda"])


def _host_buffer(shape: torch.Size, pinned: bool) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.float32, pin_memory=pinned)


# ---------------------------------------------------------------------------------------------------- checkpoints

SNAPSHOT_PREFIXES = ("phi", "delta", "adam.exp_avg", "adam.exp_avg_sq")


def snapshot_layout(model_cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of an outer-step snapshot (Replica.outer_snapshot), the order GetState serves them in."""
    with torch.device("meta"):
        model = LlamaDecoder(model_cfg)
    named = [(name, tuple(p.shape)) for name, p in named_parameters_ordered(model)]
    return [(f"{prefix}/{name}", shape) for prefix in SNAPSHOT_PREFIXES for name, shape in named]


def save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    """Write atomically: a temporary file in the same folder, fsync, rename over the old one, fsync the folder.

    A crash at any moment leaves either the previous checkpoint or the new one, never a torn file.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save({"format": CHECKPOINT_FORMAT, **payload}, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_checkpoint(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if payload.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path}: unknown checkpoint format {payload.get('format')!r}")
    return payload


# ---------------------------------------------------------------------------------------------------- a solo run


def run_training(
    train_cfg: TrainConfig,
    outer_cfg: OuterConfig,
    data_cfg: DataConfig,
    *,
    checkpoint_dir: Path,
    checkpoint_every: int,
    fresh: bool = False,
    replica_index: int = 0,
    num_replicas: int = 1,
    eval_every: int = 0,
) -> Replica:
    """Train one replica alone: H inner steps, then a solo NoLoCo outer step (group = itself), repeated.

    The full state is checkpointed atomically every ``checkpoint_every`` inner steps and at the end; started again
    with the same ``checkpoint_dir``, the run continues from the last checkpoint and reaches bit-identical weights.
    """
    if checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
    corpus = load_corpus(data_cfg)
    model_cfg = model_config_for(train_cfg.model_size, vocab_size=corpus.vocab_size, max_seq_len=train_cfg.seq_len)
    shard = ReplicaShard(
        corpus.train, replica=replica_index, num_replicas=num_replicas, seq_len=train_cfg.seq_len, seed=train_cfg.seed
    )
    replica = Replica(model_cfg, train_cfg, [shard])
    val = validation_batches(
        corpus.validation,
        seq_len=train_cfg.seq_len,
        batch_size=train_cfg.batch_size,
        num_batches=train_cfg.eval_batches,
    )
    algorithm.warn_on_unstable_hyperparameters(outer_cfg.alpha, outer_cfg.beta, outer_cfg.effective_gamma)
    checkpoint_path = checkpoint_dir / "checkpoint.pt"
    identity = {
        "model_config": model_cfg.model_dump(mode="json"),
        "train_config": train_cfg.model_dump(mode="json"),
        "tokenizer_json": corpus.tokenizer.json_text,  # so that export, eval and generate decode what it learnt
    }
    if checkpoint_path.exists() and not fresh:
        payload = load_checkpoint(checkpoint_path)
        if payload["model_config"] != identity["model_config"]:
            raise ValueError(f"{checkpoint_path} was written for another model: {payload['model_config']}")
        replica.load_state_dict(payload["replica"])
        log.info(
            "resumed from %s at inner step %d (outer step %d)", checkpoint_path, replica.inner_step, replica.outer_step
        )
    else:
        log.info("starting a fresh run: %s, %s", corpus.description, model_cfg)
    eval_every = eval_every or train_cfg.inner_steps
    recent: list[float] = []
    started = time.perf_counter()
    while replica.inner_step < train_cfg.total_steps:
        recent.append(replica.train_step())
        step = replica.inner_step
        finished = step == train_cfg.total_steps
        if step % train_cfg.inner_steps == 0 or finished:
            new_phi, new_delta = algorithm.noloco_outer_step(
                replica.fast_weights(),
                replica.phi,
                replica.delta,
                [],
                [],
                alpha=outer_cfg.alpha,
                beta=outer_cfg.beta,
                gamma=outer_cfg.effective_gamma,
            )
            replica.apply_outer_step(new_phi, new_delta)
        if step % eval_every == 0 or finished:
            val_loss = replica.evaluate(val)
            log.info(
                "step %d/%d outer %d  train %.4f  val %.4f (ppl %.3f)  lr %.2e  %.1fs",
                step,
                train_cfg.total_steps,
                replica.outer_step,
                sum(recent) / len(recent),
                val_loss,
                math.exp(val_loss),
                replica.current_lr,
                time.perf_counter() - started,
            )
            recent.clear()
        if step % checkpoint_every == 0 or finished:
            save_checkpoint(checkpoint_path, {**identity, "replica": replica.state_dict()})
    return replica
