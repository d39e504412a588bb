"""`noloco-node bench train`: training throughput (tokens/s) and model FLOPs utilisation of a named size here.

The trainer's own inner step (trainer.Replica: Adam, clipping, bf16 autocast on CUDA) runs on synthetic tokens for
``steps`` steps after a warm-up, twice in the same run:

- **planned**: the step as a node runs it here (training/step_plan.py): on a GPU the micro-batch its probe finds,
  gradients accumulated up to the batch, compiled blocks, fused Adam;
- **reference**: the step as it ran before the planner, eager and unplanned: the trainer's old defaults of 8
  sequences per step in one pass, nothing compiled.

Model FLOPs per token (step_plan.flops_per_token): 6 N for the weights' forward and backward (N parameters,
embeddings included) plus 12 L T d for attention scores and values (L layers, T tokens of context, d width).

MFU needs a peak to divide by. On a known GPU it is the vendor's dense bf16 figure; on anything else (a CPU, an
unknown GPU) the bench measures the peak it can reach in the same run with a large matmul in the training dtype,
and says so: the figure is then "utilisation of what this device's matmul reaches", not of a datasheet number.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

import numpy as np
import torch

from noloco_node.config.models import TrainConfig, model_config_for
from noloco_node.data.corpus import ReplicaShard
from noloco_node.model.decoder import parameter_count
from noloco_node.model.source import SeededDecoder
from noloco_node.training.replica import Replica, resolve_device
from noloco_node.training.step_plan import StepPlan, datasheet_peak, flops_per_token

# A step's tokens when no batch is given: on a GPU 256 sequences of 1,024 tokens (262,144 tokens, the order of an
# LLM's batch), on a CPU the trainer's 8 of 256.
GPU_BATCH, GPU_SEQ_LEN = 256, 1024
CPU_BATCH, CPU_SEQ_LEN = 8, 256
REFERENCE_BATCH = 8  # the eager, unplanned step: the trainer's old default batch, in one pass


@dataclass
class StepMeasurement:
    """One way of running the step, measured: its plan and its times."""

    label: str
    plan: StepPlan
    tokens_per_step: int
    step_seconds: list[float]

    @property
    def median_seconds(self) -> float:
        return _median(self.step_seconds)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.median_seconds


@dataclass
class TrainBenchResult:
    size: str
    device: str
    parameters: int
    vocab_size: int
    seq_len: int
    flops_per_token: float
    peak_flops: float
    peak_source: str
    planned: StepMeasurement
    reference: StepMeasurement | None

    # The planned step's figures, the bench's headline.
    @property
    def tokens_per_step(self) -> int:
        return self.planned.tokens_per_step

    @property
    def step_seconds(self) -> list[float]:
        return self.planned.step_seconds

    @property
    def tokens_per_second(self) -> float:
        return self.planned.tokens_per_second

    @property
    def mfu(self) -> float:
        return self.mfu_of(self.planned)

    def mfu_of(self, measured: StepMeasurement) -> float:
        return measured.tokens_per_second * self.flops_per_token / self.peak_flops

    def report(self) -> str:
        lines = [
            f"model {self.size}: {self.parameters / 1e6:.1f}M parameters, vocabulary {self.vocab_size}, "
            f"sequences of {self.seq_len} tokens, device {self.device}",
            f"  model FLOPs: {self.flops_per_token / 1e6:.1f} MFLOP per token (6 N + 12 L T d)",
            f"  peak: {self.peak_flops / 1e12:.3f} TFLOP/s ({self.peak_source})",
        ]
        for measured in (self.planned, self.reference):
            if measured is None:
                continue
            seconds = measured.step_seconds
            lines += [
                f"  {measured.label}: {measured.plan.summary()}",
                f"    {measured.tokens_per_step:,} tokens per step, median {measured.median_seconds * 1e3:.1f} ms over "
                f"{len(seconds)} steps (min {min(seconds) * 1e3:.1f}, max {max(seconds) * 1e3:.1f})",
                f"    throughput: {measured.tokens_per_second:,.0f} tokens/s, "
                f"{measured.tokens_per_second * self.flops_per_token / 1e12:.3f} TFLOP/s, "
                f"MFU: {self.mfu_of(measured):.1%}",
            ]
        if self.reference is not None:
            lines.append(
                f"  planned / reference: {self.planned.tokens_per_second / self.reference.tokens_per_second:.2f}x "
                "tokens/s"
            )
        return "\n".join(lines)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def measured_matmul_peak(device: torch.device, dtype: torch.dtype, *, size: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of the best of ``repeats`` square matmuls: what this device reaches in the training dtype."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats + 1):  # the first is a warm-up
        _sync(device)
        started = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        best = min(best, time.perf_counter() - started)
    return 2.0 * size**3 / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak(device: torch.device) -> tuple[float, str]:
    known = datasheet_peak(device)
    if known is not None:
        return known
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return measured_matmul_peak(device, torch.bfloat16), f"{name}: measured bf16 matmul, not on the datasheet list"
    return measured_matmul_peak(device, torch.float32), "measured fp32 matmul on this CPU, same run"


def step_shape(device: torch.device, batch_size: int | None, seq_len: int | None) -> tuple[int, int]:
    """The sequences per inner step and their length: the given ones, else the bench's default for the device."""
    on_gpu = device.type == "cuda"
    return batch_size or (GPU_BATCH if on_gpu else CPU_BATCH), seq_len or (GPU_SEQ_LEN if on_gpu else CPU_SEQ_LEN)


def synthetic_replica(
    size: str, train_cfg: TrainConfig, vocab_size: int, device: torch.device, *, steps: int
) -> Replica:
    """The trainer's own replica of a named size on synthetic tokens (enough for ``steps`` inner steps): throughput
    does not depend on what the tokens say, and a bench needs no corpus."""
    model_cfg = model_config_for(size, vocab_size=vocab_size, max_seq_len=train_cfg.seq_len)
    count = max(1 << 20, (steps + 2) * train_cfg.batch_size * (train_cfg.seq_len + 1))
    tokens = np.random.default_rng(0).integers(0, vocab_size, size=count, dtype=np.uint32)
    shard = ReplicaShard(tokens, replica=0, num_replicas=1, seq_len=train_cfg.seq_len, seed=0)
    return Replica(SeededDecoder(model_cfg, train_cfg.seed, size), train_cfg, [shard], device=device)


def _measure(
    label: str,
    size: str,
    train_cfg: TrainConfig,
    vocab_size: int,
    device: torch.device,
    *,
    steps: int,
    warmup: int,
) -> StepMeasurement:
    replica = synthetic_replica(size, train_cfg, vocab_size, device, steps=steps + warmup)
    for _ in range(warmup):
        replica.train_step()
    seconds = []
    for _ in range(steps):
        _sync(device)
        started = time.perf_counter()
        loss = replica.train_step()
        assert loss is not None
        loss.wait()  # the step is complete once its loss is there
        seconds.append(time.perf_counter() - started)
    measured = StepMeasurement(label, replica.plan, train_cfg.batch_size * train_cfg.seq_len, seconds)
    del replica
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return measured


def run_train_bench(
    size: str = "small",
    *,
    steps: int = 20,
    warmup: int = 3,
    batch_size: int | None = None,
    seq_len: int | None = None,
    vocab_size: int = 256,
    micro_batch: int | None = None,
    compile: str = "auto",
    device: str = "auto",
    reference: bool = True,
) -> TrainBenchResult:
    """The planned step (and, with ``reference``, the eager unplanned one) of a named size on this device."""
    torch_device = resolve_device(device)
    on_gpu = torch_device.type == "cuda"
    batch_size, seq_len = step_shape(torch_device, batch_size, seq_len)

    def settings(batch: int, micro: int | None, compiled: str) -> TrainConfig:
        return TrainConfig(
            model_size=size,
            batch_size=batch,
            micro_batch=micro,
            compile=compiled,
            seq_len=seq_len,
            total_steps=steps + warmup + 1,
            warmup_steps=0,
            device=device,
        )

    # The reference first: the planned step's probe then sizes itself to a card that holds one model only.
    measured_reference = (
        _measure(
            "reference (eager, unplanned)",
            size,
            settings(REFERENCE_BATCH, REFERENCE_BATCH, "off"),
            vocab_size,
            torch_device,
            steps=steps,
            warmup=warmup,
        )
        if reference
        else None
    )
    planned = _measure(
        "planned",
        size,
        settings(batch_size, micro_batch, compile),
        vocab_size,
        torch_device,
        steps=steps,
        warmup=warmup,
    )
    model_cfg = model_config_for(size, vocab_size=vocab_size, max_seq_len=seq_len)
    parameters = parameter_count(model_cfg)
    peak, source = _peak(torch_device)
    return TrainBenchResult(
        size=size,
        device=str(torch_device) + (f" ({torch.cuda.get_device_name(torch_device)})" if on_gpu else ""),
        parameters=parameters,
        vocab_size=vocab_size,
        seq_len=seq_len,
        flops_per_token=flops_per_token(parameters, model_cfg.num_layers, seq_len, model_cfg.hidden_size),
        peak_flops=peak,
        peak_source=source,
        planned=planned,
        reference=measured_reference,
    )
