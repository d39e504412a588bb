"""`noloco-node bench train`: training throughput (tokens/s) and model FLOPs utilisation of a named size here.

The trainer's own inner step (trainer.Replica: Adam, clipping, bf16 autocast on CUDA) runs on synthetic tokens for
``steps`` steps after a warm-up. Model FLOPs per token follow the usual count for a decoder: 6 N for the weights'
forward and backward (N parameters, embeddings included since the output layer uses them) plus 12 L T d for
attention scores and values (L layers, T tokens of context, d model width).

MFU needs a peak to divide by. On a known GPU it is the vendor's dense bf16 figure; on anything else (a CPU, an
unknown GPU) the bench measures the peak it can reach in the same run with a large matmul in the training dtype,
and says so: the figure is then "utilisation of what this device's matmul reaches", not of a datasheet number.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from noloco_node.config.models import TrainConfig, model_config_for
from noloco_node.data.corpus import ReplicaShard
from noloco_node.model.decoder import parameter_count
from noloco_node.model.source import SeededDecoder
from noloco_node.training.replica import Replica, resolve_device

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


@dataclass
class TrainBenchResult:
    size: str
    device: str
    parameters: int
    tokens_per_step: int
    step_seconds: list[float]
    flops_per_token: float
    peak_flops: float
    peak_source: str

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / _median(self.step_seconds)

    @property
    def mfu(self) -> float:
        return self.tokens_per_second * self.flops_per_token / self.peak_flops

    def report(self) -> str:
        return "\n".join(
            [
                f"model {self.size}: {self.parameters / 1e6:.1f}M parameters, {self.tokens_per_step} tokens per step, "
                f"device {self.device}",
                f"  step time: median {_median(self.step_seconds) * 1e3:.1f} ms over {len(self.step_seconds)} steps "
                f"(min {min(self.step_seconds) * 1e3:.1f}, max {max(self.step_seconds) * 1e3:.1f})",
                f"  throughput: {self.tokens_per_second:,.0f} tokens/s",
                f"  model FLOPs: {self.flops_per_token / 1e6:.1f} MFLOP per token, "
                f"{self.tokens_per_second * self.flops_per_token / 1e12:.3f} TFLOP/s achieved",
                f"  peak: {self.peak_flops / 1e12:.3f} TFLOP/s ({self.peak_source})",
                f"  MFU: {self.mfu:.1%}",
            ]
        )


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def flops_per_token(parameters: int, layers: int, context: int, width: int) -> float:
    return 6.0 * parameters + 12.0 * layers * context * width


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
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in GPU_PEAK_BF16.items():
            if key in name:
                return peak, f"{name}: datasheet dense bf16"
        return measured_matmul_peak(device, torch.bfloat16), f"{name}: measured bf16 matmul, not on the datasheet list"
    return measured_matmul_peak(device, torch.float32), "measured fp32 matmul on this CPU, same run"


def run_train_bench(
    size: str = "small",
    *,
    steps: int = 20,
    warmup: int = 3,
    batch_size: int = 8,
    seq_len: int = 256,
    device: str = "auto",
) -> TrainBenchResult:
    train_cfg = TrainConfig(
        model_size=size,
        batch_size=batch_size,
        seq_len=seq_len,
        total_steps=steps + warmup + 1,
        warmup_steps=0,
        device=device,
    )
    torch_device = resolve_device(train_cfg.device)
    model_cfg = model_config_for(size, vocab_size=256, max_seq_len=seq_len)
    # Synthetic tokens: throughput does not depend on what the tokens say, and the bench needs no corpus.
    count = max(1 << 20, (steps + warmup + 2) * batch_size * (seq_len + 1))
    tokens = np.random.default_rng(0).integers(0, 256, size=count, dtype=np.uint16)
    shard = ReplicaShard(tokens, replica=0, num_replicas=1, seq_len=seq_len, seed=0)
    replica = Replica(SeededDecoder(model_cfg, train_cfg.seed, size), train_cfg, [shard], device=torch_device)
    for _ in range(warmup):
        replica.train_step()
    seconds = []
    for _ in range(steps):
        _sync(torch_device)
        started = time.perf_counter()
        replica.train_step()  # returns the loss as a float: the step is complete when it returns
        _sync(torch_device)
        seconds.append(time.perf_counter() - started)
    peak, source = _peak(torch_device)
    return TrainBenchResult(
        size=size,
        device=str(torch_device)
        + (f" ({torch.cuda.get_device_name(torch_device)})" if torch_device.type == "cuda" else ""),
        parameters=parameter_count(model_cfg),
        tokens_per_step=batch_size * seq_len,
        step_seconds=seconds,
        flops_per_token=flops_per_token(
            parameter_count(model_cfg), model_cfg.num_layers, seq_len, model_cfg.hidden_size
        ),
        peak_flops=peak,
        peak_source=source,
    )
