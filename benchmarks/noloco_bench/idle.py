"""`noloco-node bench idle`: how much of its time a trainer spends waiting on peers, per pairing mode, and how much
memory a node takes next to the bare model and optimizer.

For each pairing mode a local swarm of ``nodes`` real node processes trains the same ``steps`` inner steps. The
idle fraction of a node is the share of its trainer's wall time spent waiting for communication at outer steps
(``comm_wait_fraction`` of its status: waiting for a partner and for the exchange in sync mode; taking the
nearest offer in overlap mode), read from its final status.json. Memory is each node's peak resident set
(VmHWM, sampled while it runs) against a reference measured in the same run: a process that imports torch,
builds the same model with Adam and takes one training step (weights, gradients and both moments allocated), so
the difference is what being a swarm member costs (DHT, gRPC, buffers, outer state, snapshot).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from noloco_node.launcher.local_swarm import LocalSwarm
from noloco_node.observability.status_file import read_status_document

_BARE = """
import sys, torch
from noloco_node.config.models import TrainConfig, model_config_for
from noloco_node.model.decoder import LlamaDecoder
torch.set_num_threads(1)
cfg = model_config_for(sys.argv[1], vocab_size=256, max_seq_len=int(sys.argv[2]))
model = LlamaDecoder(cfg)
optimizer = torch.optim.Adam(model.parameters())
tokens = torch.randint(0, 256, (int(sys.argv[3]), int(sys.argv[2])))
model.loss(tokens, tokens).backward()
optimizer.step()
from noloco_node.node.report import peak_rss_mb
print(peak_rss_mb())
"""


@dataclass
class ModeResult:
    mode: str
    idle: list[float] = field(default_factory=list)  # per node
    peak_rss_mb: list[float] = field(default_factory=list)
    seconds: float = 0.0
    blends: int = 0
    outer_steps: int = 0
    blend_seconds: list[float] = field(default_factory=list)  # per outer step, all nodes
    upkeep_seconds: list[float] = field(default_factory=list)  # per outer step, all nodes


@dataclass
class IdleBenchResult:
    nodes: int
    steps: int
    model: str
    bare_rss_mb: float
    modes: list[ModeResult]

    def report(self) -> str:
        lines = [f"{self.nodes} nodes, model {self.model}, {self.steps} inner steps each"]
        for mode in self.modes:
            lines.append(
                f"  {mode.mode:<8} trainer idle: mean {statistics.mean(mode.idle):.2%}, max {max(mode.idle):.2%} "
                f"(per node: {', '.join(f'{v:.2%}' for v in mode.idle)}); {mode.blends}/{mode.outer_steps} outer "
                f"steps blended; {mode.seconds:.0f} s"
            )
            lines.append(
                f"  {'':<8} trainer time per outer step outside the inner phase and the wait: blend "
                f"{1000 * statistics.mean(mode.blend_seconds):.1f} ms, upkeep (snapshot, checkpoint, status) mean "
                f"{1000 * statistics.mean(mode.upkeep_seconds):.1f} ms, max {1000 * max(mode.upkeep_seconds):.1f} ms"
            )
        all_peaks = [peak for mode in self.modes for peak in mode.peak_rss_mb]
        lines.append(
            f"  peak RSS of a node: mean {statistics.mean(all_peaks):.0f} MB, max {max(all_peaks):.0f} MB; a bare "
            f"process with the same model, Adam and one step: {self.bare_rss_mb:.0f} MB (same run); a node costs "
            f"{statistics.mean(all_peaks) - self.bare_rss_mb:.0f} MB more"
        )
        return "\n".join(lines)


def _bare_rss_mb(model: str, seq_len: int, batch_size: int) -> float:
    done = subprocess.run(
        [sys.executable, "-c", _BARE, model, str(seq_len), str(batch_size)],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return float(done.stdout.strip().splitlines()[-1])


def _run_mode(mode: str, nodes: int, steps: int, train_args: list[str], base: Path) -> ModeResult:
    result = ModeResult(mode)
    # The nodes start training together: one that came up late would join the others' run in progress, and an
    # early one might train alone, so the idle it measures would not be a swarm's.
    swarm = LocalSwarm(
        base / mode,
        nodes,
        ["--mode", mode, "--steps", str(steps), "--log-every", "60", "--wait-for-peers", str(nodes - 1), *train_args],
    )
    started = time.monotonic()
    try:
        while swarm.running():
            time.sleep(0.5)
            if time.monotonic() - started > 3600:
                raise TimeoutError(f"the {mode} swarm did not finish within an hour")
        result.seconds = time.monotonic() - started
    finally:
        swarm.stop()
    crashed = [slot.index for slot in swarm.slots if slot.crashes]
    if crashed:
        raise RuntimeError(f"nodes {crashed} of the {mode} swarm failed; see {base / mode}")
    for slot in swarm.slots:
        status = read_status_document(slot.data_dir)
        if status is None:
            raise RuntimeError(f"node {slot.index} of the {mode} swarm left no status; see {base / mode}")
        result.idle.append(status["comm_wait_fraction"])
        result.blends += sum(1 for h in status["history"] if h["partner"])
        result.outer_steps += len(status["history"])
        result.blend_seconds += [h.get("blend_seconds", 0.0) for h in status["history"]]
        result.upkeep_seconds += [h.get("upkeep_seconds", 0.0) for h in status["history"]]
        # The node's own VmHWM in its last status: sampling /proc from here missed a node's peak once (a node of a
        # busy machine read below a bare model), and a process's peak is gone once it has exited.
        result.peak_rss_mb.append(status["peak_rss_mb"])
    return result


def run_idle_bench(
    nodes: int = 4,
    steps: int = 600,
    model: str = "tiny",
    *,
    seq_len: int = 128,
    batch_size: int = 8,
    modes: tuple[str, ...] = ("sync", "stream", "overlap"),
    out: Path | None = None,
) -> IdleBenchResult:
    train_args = ["--model", model, "--seq-len", str(seq_len), "--batch-size", str(batch_size)]
    with tempfile.TemporaryDirectory(prefix="noloco-bench-idle-") as scratch:
        base = out or Path(scratch)
        results = [_run_mode(mode, nodes, steps, train_args, base) for mode in modes]
    return IdleBenchResult(nodes, steps, model, _bare_rss_mb(model, seq_len, batch_size), results)
