"""How one member runs its inner step on its own hardware: the micro-batch, the accumulation, compile, checkpointing.

The run fixes the tokens of an inner step (``batch_size`` x ``seq_len``, in the fingerprint: it changes the
algorithm). How a member computes them is its own: a 24 GB card and an H200 of one run split the same batch into
different micro-batches and accumulate the gradients, which is the same maths (the losses of equal micro-batches
averaged). This module decides that split, and says what it expects of it:

- on a GPU, with the micro-batch unset, a **probe** at start: a forward and backward pass of one and of two
  synthetic sequences (eager, weights untouched, gradients dropped) measure the device memory a step needs beyond
  a fixed part, per sequence; the largest micro-batch that divides the batch and stays under :data:`MEMORY_MARGIN`
  of the card's memory is taken (Adam's moments counted when they do not exist yet). Then the blocks are compiled
  and two micro-batches are timed: the predicted tokens/s and MFU. A compile that fails falls back to eager, and
  the plan says why.
- without a GPU to probe (a CPU; ``doctor --gpu-memory``), the **memory model** alone: the same fixed and
  per-sequence parts from the parameter count and the shape (:func:`model_memory`), with the activation bytes per
  token per layer measured on an H100 (docs/benchmarks.md, "Filling the GPU").

On a GPU the plan also places the **outer state** (phi and delta, fp32: :data:`OUTER_STATE_BYTES` per parameter).
On the GPU the outer step is a few passes over device memory; on the host it is bound by the host's memory
bandwidth (2.7 s for one blend at 1.3b on 16 cores of an H100 machine, and the loss check computes two). ``auto``
keeps it on the GPU when the micro-batch stays what it would be without it: the inner steps come first.

The plan is logged at start, shown in ``/status`` and printed by ``doctor``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from noloco_node.config.models import ModelConfig, TrainConfig
from noloco_node.model.decoder import LlamaDecoder, autocast_context, parameter_count

log = logging.getLogger(__name__)

GIB = 2**30
# The share of the card's memory a plan may use: the rest absorbs the allocator's fragmentation, the outer step's
# chunks and whatever else runs on the card.
MEMORY_MARGIN = 0.85
# Device bytes per parameter: fp32 weights, fp32 gradients, Adam's two moments. (Autocast's bf16 copies of the
# weights are alive during the forward pass, the gradients fill in during the backward: the probe on an H100 put
# the fixed part at 14-15 B/param with Adam, so 16 errs on the safe side.)
WEIGHT_BYTES, GRADIENT_BYTES, ADAM_BYTES = 4, 4, 8
# A member sharded over several ranks (training/data_parallel.py) holds whole, besides its shards, the weights of
# the root unit (embeddings, final norm, head) and of two blocks at a time (the one computing, the next gathered).
GATHERED_BLOCKS = 2
# The outer state, phi and delta in fp32, where the plan keeps it on the GPU.
OUTER_STATE_BYTES = 8
# Saved activations per token and layer, bytes = ACTIVATION_HIDDEN x hidden + ACTIVATION_FFN x intermediate: eager
# blocks under bf16 autocast with flash attention, fitted to the probe on an H100 (125m: 53 KB, 1.3b: 137 KB per
# token and layer; compiled blocks keep about a third less). Checkpointed, a block keeps its fp32 input.
ACTIVATION_HIDDEN, ACTIVATION_FFN = 20, 12
CHECKPOINTED_HIDDEN = 4

# Dense bf16 tensor-core peaks (FLOP/s), from the vendors' datasheets (SXM parts where there are two).
GPU_PEAK_BF16 = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "A10G": 125e12,
    "L40S": 362e12,
    "L4": 121e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
}


def flops_per_token(parameters: int, layers: int, context: int, width: int) -> float:
    """Model FLOPs of one trained token: 6 N for the weights' forward and backward (N parameters, embeddings
    included) plus 12 L T d for attention scores and values (L layers, T tokens of context, d model width)."""
    return 6.0 * parameters + 12.0 * layers * context * width


def datasheet_peak(device: torch.device) -> tuple[float, str] | None:
    """The card's dense bf16 peak and where the figure comes from, for the GPUs of :data:`GPU_PEAK_BF16`."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in GPU_PEAK_BF16.items():
        if key in name:
            return peak, f"{name}: datasheet dense bf16"
    return None


@dataclass(frozen=True)
class ModelMemory:
    """Device memory of a step: a fixed part (weights, gradients, Adam) and a part per sequence of a micro-batch."""

    fixed_bytes: int
    per_sequence_bytes: int
    outer_state_bytes: int = 0  # phi and delta, where the plan puts them on the GPU

    def micro_batch_fits(self, micro_batch: int, memory_bytes: int, *, besides: int = 0) -> bool:
        """Whether ``micro_batch`` sequences fit under the margin, with ``besides`` bytes more (the outer state)."""
        return self.fixed_bytes + besides + micro_batch * self.per_sequence_bytes <= MEMORY_MARGIN * memory_bytes

    def largest_micro_batch(self, batch_size: int, memory_bytes: int, *, besides: int = 0) -> int:
        """The largest micro-batch that divides the batch and fits beside ``besides`` bytes; 0 when none does."""
        room = (MEMORY_MARGIN * memory_bytes - self.fixed_bytes - besides) // max(1, self.per_sequence_bytes)
        return largest_divisor_at_most(batch_size, int(room)) if room >= 1 else 0

    def place_outer_state(
        self, setting: str, batch_size: int, memory_bytes: int, micro_batch: int | None
    ) -> tuple[int, bool]:
        """The micro-batch and whether the outer state goes on the GPU. ``auto``: on the GPU when the micro-batch
        (``micro_batch`` when set) stays what it would be without it, else on the host."""
        outer_bytes = self.outer_state_bytes
        if micro_batch is not None:
            fits = self.micro_batch_fits(micro_batch, memory_bytes, besides=outer_bytes)
            return micro_batch, setting == "device" or (setting == "auto" and fits)
        alone = self.largest_micro_batch(batch_size, memory_bytes)
        beside = self.largest_micro_batch(batch_size, memory_bytes, besides=outer_bytes)
        on_device = setting == "device" or (setting == "auto" and beside == alone and beside > 0)
        return (beside if on_device else alone), on_device


def model_memory(model_cfg: ModelConfig, seq_len: int, *, checkpointed: bool = False, ranks: int = 1) -> ModelMemory:
    """The memory model of a decoder of this shape (no probe): what ``doctor``, a CPU member and a sharded member
    use. Over ``ranks`` ranks each holds its share of the weights, gradients and Adam, and the units being
    gathered whole."""
    parameters = parameter_count(model_cfg)
    per_parameter = WEIGHT_BYTES + GRADIENT_BYTES + ADAM_BYTES
    fixed = parameters * per_parameter
    if ranks > 1:
        embeddings = model_cfg.vocab_size * model_cfg.hidden_size * (1 if model_cfg.tie_embeddings else 2)
        block = (parameters - embeddings) // max(1, model_cfg.num_layers)
        fixed = -(-fixed // ranks) + (embeddings + GATHERED_BLOCKS * block) * WEIGHT_BYTES
    hidden, ffn = model_cfg.hidden_size, model_cfg.intermediate_size
    per_layer = CHECKPOINTED_HIDDEN * hidden if checkpointed else ACTIVATION_HIDDEN * hidden + ACTIVATION_FFN * ffn
    # Checkpointed, one block's activations are alive again during its backward pass.
    recomputed = (ACTIVATION_HIDDEN * hidden + ACTIVATION_FFN * ffn) * seq_len if checkpointed else 0
    per_token = model_cfg.num_layers * per_layer + 2 * hidden  # + the loss's gradient of the hidden states (bf16)
    return ModelMemory(fixed, per_token * seq_len + recomputed, OUTER_STATE_BYTES * parameters)


def largest_divisor_at_most(batch_size: int, limit: int) -> int:
    """The largest micro-batch <= limit that divides the batch (every micro-batch of a step the same size); 0 when
    even one sequence is over the limit."""
    for candidate in range(min(batch_size, limit), 0, -1):
        if batch_size % candidate == 0:
            return candidate
    return 0


@dataclass
class StepPlan:
    """How this member runs an inner step, and what it expects of it."""

    device: str
    batch_size: int
    seq_len: int
    micro_batch: int
    compiled: bool
    checkpointed: bool
    source: str  # "settings", "probe" or "memory model": where the micro-batch came from
    outer_state_on_device: bool = True  # phi and delta on the training device (a CPU's always are), or the host
    memory_bytes: int | None = None  # the card's
    peak_bytes: int | None = None  # predicted (memory model, probe fit) or measured (the compiled probe)
    tokens_per_second: float | None = None  # measured by the probe (forward and backward, no optimizer step)
    mfu: float | None = None
    ranks: int = 1  # the GPUs of a member that shards the model over them (training/data_parallel.py)
    notes: list[str] = field(default_factory=list)

    @property
    def accumulation(self) -> int:
        return self.batch_size // self.micro_batch

    def summary(self) -> str:
        parts = [
            f"micro-batch {self.micro_batch} x {self.seq_len} tokens, {self.accumulation} accumulated "
            f"= {self.batch_size * self.seq_len:,} tokens per inner step ({self.source})",
            f"compile {'on' if self.compiled else 'off'}",
            f"activation checkpointing {'on' if self.checkpointed else 'off'}",
        ]
        if self.ranks > 1:
            parts.append(f"the model sharded over {self.ranks} ranks")
        if not self.device.startswith("cpu"):
            parts.append(f"outer state on the {'GPU' if self.outer_state_on_device else 'host'}")
        if self.peak_bytes is not None and self.memory_bytes:
            parts.append(f"memory {self.peak_bytes / GIB:.1f} of {self.memory_bytes / GIB:.1f} GiB")
        if self.tokens_per_second is not None:
            parts.append(f"predicted {self.tokens_per_second:,.0f} tokens/s")
        if self.mfu is not None:
            parts.append(f"MFU {self.mfu:.1%}")
        return f"step plan on {self.device}: " + ", ".join(parts) + "".join(f"; {note}" for note in self.notes)

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "accumulation": self.accumulation}


def wanted(setting: str, default: bool) -> bool:
    return default if setting == "auto" else setting == "on"


def plan_without_probe(
    train_cfg: TrainConfig, device: torch.device, *, compilable: bool, parameters: int = 0
) -> StepPlan:
    """The plan where nothing is probed: a CPU member, or a GPU member whose micro-batch is set with compile off.
    The whole batch at once unless micro_batch says otherwise; compiled only when asked (auto is off on a CPU) and
    the model is the project's decoder. On a GPU the outer state of ``parameters`` goes beside the weights,
    gradients and Adam when they fit under the margin of the card (activations unmeasured: the setting's own
    micro-batch is the user's call)."""
    micro = train_cfg.micro_batch or train_cfg.batch_size
    on_device = True
    if device.type == "cuda":
        _free, total = torch.cuda.mem_get_info(device)
        memory = ModelMemory(
            parameters * (WEIGHT_BYTES + GRADIENT_BYTES + ADAM_BYTES), 0, OUTER_STATE_BYTES * parameters
        )
        on_device = memory.place_outer_state(train_cfg.outer_state, train_cfg.batch_size, total, micro)[1]
    return StepPlan(
        device=str(device),
        batch_size=train_cfg.batch_size,
        seq_len=train_cfg.seq_len,
        micro_batch=micro,
        compiled=compilable and wanted(train_cfg.compile, device.type == "cuda"),
        checkpointed=compilable and wanted(train_cfg.activation_checkpointing, False),
        source="settings",
        outer_state_on_device=on_device,
    )


def plan_for_memory(model_cfg: ModelConfig, train_cfg: TrainConfig, memory_bytes: int, *, ranks: int = 1) -> StepPlan:
    """The plan the memory model gives a card of ``memory_bytes`` (one of ``ranks`` that shard the model): the
    largest micro-batch that fits, checkpointing only when one sequence does not fit without it. ``micro_batch`` 0
    when nothing fits (the plan's notes say why): the caller refuses the size."""
    plain = model_memory(model_cfg, train_cfg.seq_len, ranks=ranks)
    checkpointed_memory = model_memory(model_cfg, train_cfg.seq_len, checkpointed=True, ranks=ranks)
    checkpointed = wanted(train_cfg.activation_checkpointing, not plain.micro_batch_fits(1, memory_bytes))
    memory = checkpointed_memory if checkpointed else plain
    # A sharded member keeps its outer state whole on rank 0's host (training/replica.py).
    outer_setting = train_cfg.outer_state if ranks == 1 else "host"
    micro, on_device = memory.place_outer_state(
        outer_setting, train_cfg.batch_size, memory_bytes, train_cfg.micro_batch
    )
    plan = StepPlan(
        device=f"a GPU of {memory_bytes / GIB:.0f} GiB",
        batch_size=train_cfg.batch_size,
        seq_len=train_cfg.seq_len,
        micro_batch=micro,
        compiled=wanted(train_cfg.compile, True),
        checkpointed=checkpointed,
        source="memory model",
        outer_state_on_device=on_device,
        memory_bytes=memory_bytes,
        ranks=ranks,
        peak_bytes=memory.fixed_bytes
        + max(micro, 1) * memory.per_sequence_bytes
        + (memory.outer_state_bytes if on_device else 0),
    )
    besides = memory.outer_state_bytes if on_device else 0
    if micro == 0 or not memory.micro_batch_fits(micro, memory_bytes, besides=besides):
        plan.notes.append(
            f"does not fit: {memory.fixed_bytes / GIB:.1f} GiB for weights, gradients and Adam"
            + (f" (this rank's share of {ranks}, and the units gathered whole) " if ranks > 1 else " ")
            + f"({parameter_count(model_cfg) / 1e9:.2f}B parameters x "
            f"{memory.fixed_bytes // max(1, parameter_count(model_cfg))} B)"
            + (f" + {besides / GIB:.1f} GiB of outer state on the GPU" if besides else "")
            + f" + {memory.per_sequence_bytes / GIB:.2f} GiB per sequence of {train_cfg.seq_len} tokens, over "
            f"{MEMORY_MARGIN:.0%} of {memory_bytes / GIB:.1f} GiB"
        )
    return plan


def fewest_ranks_to_fit(
    model_cfg: ModelConfig, train_cfg: TrainConfig, memory_bytes: int, *, most: int = 8
) -> StepPlan | None:
    """The plan of the fewest ranks (2 to ``most`` GPUs of ``memory_bytes`` each, one member sharding the model)
    on which a model that one such GPU cannot hold fits; None when even ``most`` are not enough."""
    for ranks in range(2, most + 1):
        plan = plan_for_memory(model_cfg, train_cfg, memory_bytes, ranks=ranks)
        if plan.micro_batch > 0 and not plan.notes:
            return plan
    return None


# ---------------------------------------------------------------------------------------------- the probe on a GPU


def probe_plan(
    model: torch.nn.Module,
    train_cfg: TrainConfig,
    device: torch.device,
    *,
    optimizer_state_exists: bool,
    agree: Callable[[int], int] = lambda micro: micro,
) -> StepPlan:
    """Measure the memory of a step on this GPU and choose the micro-batch; compile the blocks and time it.

    The weights are not changed (forward and backward passes on synthetic tokens, gradients dropped). ``agree``
    lets the ranks of a multi-GPU member settle on one micro-batch (the smallest). Only the project's decoder is
    compiled or checkpointed; another model runs eager."""
    decoder = model if isinstance(model, LlamaDecoder) else None
    # What this process may use: the card's free memory and what it holds already (its model). Another process on
    # the same card (two members on one GPU) keeps what it has.
    free, _total = torch.cuda.mem_get_info(device)
    memory_bytes = free + torch.cuda.memory_reserved(device)
    missing_state = 0 if optimizer_state_exists else ADAM_BYTES * sum(p.numel() for p in model.parameters())
    checkpointed = wanted(train_cfg.activation_checkpointing, False)
    if decoder is not None:
        decoder.run_blocks(compiled=False, checkpointed=checkpointed)
    notes: list[str] = []
    peaks = {}
    for count in (1, 2):
        peaks[count] = _peak_of_pass(model, train_cfg.seq_len, count, device)
        if peaks[count] is None and count == 1 and not checkpointed and decoder is not None:
            # Not even one sequence fits: checkpointing keeps only each block's input.
            checkpointed = train_cfg.activation_checkpointing != "off"
            if checkpointed:
                decoder.run_blocks(compiled=False, checkpointed=True)
                notes.append("activation checkpointing: one sequence does not fit without it")
                peaks[count] = _peak_of_pass(model, train_cfg.seq_len, count, device)
        if peaks[count] is None:
            break
    one, two = peaks[1], peaks.get(2)
    if one is None:
        raise PlanError(
            f"not even one sequence of {train_cfg.seq_len} tokens fits on this GPU ({memory_bytes / GIB:.1f} GiB): "
            "pick a smaller --model or --seq-len (`noloco-node doctor` says what fits)"
        )
    per_sequence = max(1, (two - one) if two is not None else one)
    fixed = one - per_sequence + missing_state
    log.info(
        "step probe: %.2f GiB fixed (Adam's moments included), %.3f GiB per sequence of %d tokens (eager%s)",
        fixed / GIB,
        per_sequence / GIB,
        train_cfg.seq_len,
        ", checkpointed" if checkpointed else "",
    )
    parameters = sum(p.numel() for p in model.parameters())
    measured = ModelMemory(fixed, per_sequence, OUTER_STATE_BYTES * parameters)
    micro, on_device = measured.place_outer_state(
        train_cfg.outer_state, train_cfg.batch_size, memory_bytes, train_cfg.micro_batch
    )
    micro = agree(max(1, micro))
    if on_device:
        missing_state += measured.outer_state_bytes  # allocated once the plan is made (training/replica.py)
        fixed += measured.outer_state_bytes
    plan = StepPlan(
        device=f"{device} ({torch.cuda.get_device_name(device)})",
        batch_size=train_cfg.batch_size,
        seq_len=train_cfg.seq_len,
        micro_batch=micro,
        compiled=False,
        checkpointed=checkpointed,
        source="settings" if train_cfg.micro_batch else "probe",
        outer_state_on_device=on_device,
        memory_bytes=memory_bytes,
        peak_bytes=fixed + micro * per_sequence,
        notes=notes,
    )
    compile_wanted = decoder is not None and wanted(train_cfg.compile, True)
    if compile_wanted:
        assert decoder is not None
        decoder.run_blocks(compiled=True, checkpointed=checkpointed)
        try:
            _timed_passes(model, train_cfg.seq_len, micro, device, plan, missing_state)
            plan.compiled = True
        except Exception as error:  # a compiler that cannot build this model: train eager, and say why
            decoder.run_blocks(compiled=False, checkpointed=checkpointed)
            plan.notes.append(f"compile fell back to eager: {type(error).__name__}: {str(error).splitlines()[0]}")
            log.warning("torch.compile failed, training eager instead: %r", error)
    if not plan.compiled:
        _timed_passes(model, train_cfg.seq_len, micro, device, plan, missing_state)
    return plan


class PlanError(RuntimeError):
    """A model that does not fit this device at all."""


def _synthetic_batch(seq_len: int, count: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator(device="cpu").manual_seed(0)  # the run's RNG is left alone
    tokens = torch.randint(0, vocab, (count, seq_len + 1), generator=generator).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def _one_pass(model: torch.nn.Module, seq_len: int, count: int, device: torch.device) -> None:
    inputs, targets = _synthetic_batch(seq_len, count, int(getattr(model, "vocab_size", 2)), device)
    try:
        model.train()
        with autocast_context(device):
            loss = model(inputs, targets)
        loss.backward()
    finally:
        for param in model.parameters():
            param.grad = None


def _peak_of_pass(model: torch.nn.Module, seq_len: int, count: int, device: torch.device) -> int | None:
    """Peak device bytes of one forward and backward pass of ``count`` sequences; None when it does not fit."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    try:
        _one_pass(model, seq_len, count, device)
        torch.cuda.synchronize(device)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None
    return int(torch.cuda.max_memory_allocated(device))


def _timed_passes(
    model: torch.nn.Module, seq_len: int, micro: int, device: torch.device, plan: StepPlan, missing_state: int
) -> None:
    """Two untimed passes (the compile happens in the first), then two timed: the plan's tokens/s and MFU, and the
    measured peak (with Adam's moments added where they do not exist yet)."""
    torch.cuda.reset_peak_memory_stats(device)
    for _ in range(2):
        _one_pass(model, seq_len, micro, device)
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(2):
        _one_pass(model, seq_len, micro, device)
    torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - started) / 2
    plan.peak_bytes = int(torch.cuda.max_memory_allocated(device)) + missing_state
    plan.tokens_per_second = micro * seq_len / seconds
    peak = datasheet_peak(device)
    config = getattr(model, "config", None)
    if peak is not None and isinstance(config, ModelConfig):
        per_token = flops_per_token(
            sum(p.numel() for p in model.parameters()), config.num_layers, seq_len, config.hidden_size
        )
        plan.mfu = plan.tokens_per_second * per_token / peak[0]
