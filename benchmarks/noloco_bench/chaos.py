"""`noloco-node bench chaos`: a local swarm trains while its nodes are SIGKILLed and come back, one at a time.

Two runs of the same swarm (same nodes, model, data and seed):
1. without faults, S inner steps, S chosen so that it takes about ``minutes`` here (from a 30 s trial run);
2. with faults, the same S inner steps: for as long as the first run took, about every ``kill_every`` seconds a
   random node (never node0, whose memory is sampled) is SIGKILLed mid-whatever-it-was-doing and after a few
   seconds either restarted on its data directory (a crash and restart: it resumes from its checkpoint, or
   downloads fresh state when the swarm is far ahead) or replaced by a newcomer with an empty one (it joins by
   downloading a donor's state).

The report: nodes that crashed on their own (must be 0), exchanges by outcome, restarts and joins by state
download, any NaN/Inf in any node's final state, and the final validation loss of both runs at S steps. With
``--no-baseline`` only the faulty run happens, faults for ``minutes`` (a soak: node0's RSS is sampled throughout).
"""

from __future__ import annotations

import json
import math
import random
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from noloco_node.launcher.local_swarm import LocalSwarm, NodeSlot, steps_per_second

UNBOUNDED_STEPS = 10_000_000


@dataclass
class SwarmRun:
    label: str
    seconds: float = 0.0
    steps: int = 0
    final_val_losses: list[float] = field(default_factory=list)
    crashes: list[int] = field(default_factory=list)
    kills: int = 0
    restarts: int = 0
    newcomers: int = 0
    joins_by_download: int = 0
    resumed_downloads: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    non_finite: list[str] = field(default_factory=list)
    rss_mb: list[tuple[float, float]] = field(default_factory=list)  # (seconds since start, node0 RSS)

    @property
    def mean_val_loss(self) -> float:
        return statistics.mean(self.final_val_losses) if self.final_val_losses else math.nan


@dataclass
class ChaosResult:
    chaos: SwarmRun
    baseline: SwarmRun | None

    def report(self) -> str:
        chaos, base = self.chaos, self.baseline
        lines = []
        if base is not None:
            lines.append(
                f"without faults: {len(base.final_val_losses)} nodes, {base.steps} inner steps in "
                f"{base.seconds:.0f} s, final val loss {base.mean_val_loss:.4f} (mean over nodes)"
            )
        lines += [
            f"with faults:    {chaos.kills} SIGKILLs ({chaos.restarts} restarts on their data dir, "
            f"{chaos.newcomers} newcomers with an empty one) over {chaos.seconds:.0f} s",
            f"  nodes that crashed on their own: {len(chaos.crashes)}"
            + (f" (exit codes {chaos.crashes})" if chaos.crashes else ""),
            f"  joins by state download: {chaos.joins_by_download} "
            f"({chaos.resumed_downloads} resumed from a second donor)",
            "  exchanges by outcome (each counted by both sides): "
            + ", ".join(f"{k} {v}" for k, v in sorted(chaos.outcomes.items())),
            f"  NaN/Inf in any final state: {', '.join(chaos.non_finite) if chaos.non_finite else 'none'}",
        ]
        if base is not None:
            lines.append(
                f"  final val loss {chaos.mean_val_loss:.4f} at the same {chaos.steps} inner steps: "
                f"{chaos.mean_val_loss / base.mean_val_loss - 1:+.1%} against the run without faults"
            )
        if chaos.rss_mb:
            lines.append(_rss_summary(chaos.rss_mb))
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        def run(r: SwarmRun | None) -> dict[str, Any] | None:
            if r is None:
                return None
            return {**r.__dict__, "outcomes": dict(r.outcomes), "mean_val_loss": r.mean_val_loss}

        return {"chaos": run(self.chaos), "baseline": run(self.baseline)}


def _rss_summary(samples: list[tuple[float, float]]) -> str:
    warm = [(t, rss) for t, rss in samples if t >= 120] or samples
    first, last = warm[0], warm[-1]
    slope = (last[1] - first[1]) / max(1.0, last[0] - first[0]) * 600
    marks, next_mark = [], 0.0
    for t, rss in samples:  # one reading every 5 minutes, for a long run's curve
        if t >= next_mark:
            marks.append(f"{t / 60:.0f} min {rss:.0f} MB")
            next_mark = t + 300
    return (
        f"  node0 RSS after warm-up (from {first[0]:.0f} s): {first[1]:.0f} MB -> {last[1]:.0f} MB at "
        f"{last[0]:.0f} s, min {min(r for _, r in warm):.0f}, max {max(r for _, r in warm):.0f}, "
        f"trend {slope:+.1f} MB per 10 min\n  node0 RSS over the run: " + ", ".join(marks)
    )


def _rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _node_args(model: str, steps: int, inner_steps: int) -> list[str]:
    return [
        "--model",
        model,
        "--steps",
        str(steps),
        "--inner-steps",
        str(inner_steps),
        "--eval-batches",
        "4",
        "--pair-timeout",
        "5",
        "--exchange-timeout",
        "20",
        "--record-ttl",
        "10",
        "--log-every",
        "30",
    ]


def _finish(swarm: LocalSwarm, run: SwarmRun, at_step: int | None) -> None:
    """Collect final losses (at ``at_step`` if given: the history entry of that inner step) and check states."""
    for slot in swarm.slots:
        status = swarm.status(slot)
        history = (status or {}).get("history", [])
        if at_step is not None:
            history = [h for h in history if h["inner_step"] <= at_step]
        if history:
            run.final_val_losses.append(history[-1]["val_loss"])
        run.non_finite += _non_finite_tensors(slot)
        log = swarm.logs(slot)
        run.joins_by_download += log.count("joined a run in progress")
        run.resumed_downloads += log.count("resumed where another donor stopped")
        run.outcomes.update(slot.outcomes)
        run.crashes += slot.crashes


def _non_finite_tensors(slot: NodeSlot) -> list[str]:
    path = slot.data_dir / "checkpoint.pt"
    if not path.exists():
        return []
    state = torch.load(path, map_location="cpu", weights_only=True)
    bad: list[str] = []

    def visit(prefix: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if value.is_floating_point() and not bool(torch.isfinite(value.float()).all()):
                bad.append(f"node{slot.index}:{prefix}")
        elif isinstance(value, dict):
            for key, item in value.items():
                visit(f"{prefix}.{key}", item)
        elif isinstance(value, list | tuple):
            for i, item in enumerate(value):
                visit(f"{prefix}[{i}]", item)

    visit("checkpoint", state)
    return bad


def _calibrate(base: Path, nodes: int, model: str, inner_steps: int, minutes: float) -> int:
    """The inner steps this swarm trains in ``minutes`` on this machine: a 30 s trial once every node trains, then
    scaled. Both runs train exactly that many steps, so that they follow the same learning-rate schedule."""
    swarm = LocalSwarm(base, nodes, _node_args(model, UNBOUNDED_STEPS, inner_steps))
    try:
        # Six nodes starting on two cores take most of a minute to come up: the trial starts when all train.
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not all(
            (swarm.status(slot) or {}).get("inner_step", 0) > 0 for slot in swarm.slots
        ):
            swarm.poll()
            if any(slot.crashes for slot in swarm.slots):
                break
            time.sleep(0.5)
        time.sleep(30.0)  # the trial: a window of training, not a synchronisation
    finally:
        swarm.stop()
    rates = [steps_per_second((swarm.status(slot) or {}).get("history", [])) for slot in swarm.slots]
    swarm.poll()
    if any(slot.crashes for slot in swarm.slots) or not any(r > 0 for r in rates):
        raise RuntimeError(f"the calibration swarm did not train; see the node logs in {base}")
    rate = min(r for r in rates if r > 0)
    return max(inner_steps * 5, int(rate * minutes * 60 / inner_steps) * inner_steps)


def _run(
    base: Path,
    label: str,
    nodes: int,
    model: str,
    inner_steps: int,
    *,
    steps: int,
    fault_seconds: float,
    kill_every: float,
    rng: random.Random | None,
) -> SwarmRun:
    """Train the swarm to ``steps`` inner steps; with ``rng``, kill a node about every ``kill_every`` seconds for
    the first ``fault_seconds``."""
    run = SwarmRun(label, steps=steps)
    swarm = LocalSwarm(base, nodes, _node_args(model, steps, inner_steps))
    started = time.monotonic()
    next_kill = started + kill_every * (rng.uniform(0.7, 1.3) if rng else 1.0)
    next_sample = started
    deadline = started + fault_seconds * 4 + 600
    try:
        while time.monotonic() < deadline and swarm.running():
            time.sleep(0.5)
            swarm.poll()
            now = time.monotonic()
            if now >= next_sample:
                rss = _rss_mb(swarm.slots[0].process.pid) if swarm.slots[0].process else None
                if rss is not None:
                    run.rss_mb.append((now - started, rss))
                next_sample = now + 10.0
            victims = [slot for slot in swarm.running() if slot.index != 0]
            if rng is not None and now >= next_kill and now - started < fault_seconds and victims:
                victim = rng.choice(victims)
                swarm.kill(victim)
                run.kills += 1
                time.sleep(rng.uniform(2.0, 5.0))
                if rng.random() < 0.5:
                    swarm.start(victim)  # crash and restart: resumes from its checkpoint
                    run.restarts += 1
                else:
                    swarm.replace(victim)  # gone for good; a newcomer joins in its place
                    run.newcomers += 1
                next_kill = time.monotonic() + kill_every * rng.uniform(0.7, 1.3)
    finally:
        swarm.stop()
    run.seconds = time.monotonic() - started
    _finish(swarm, run, at_step=steps)
    return run


def run_chaos_bench(
    *,
    minutes: float,
    nodes: int = 6,
    model: str = "tiny",
    inner_steps: int = 20,
    kill_every: float = 60.0,
    baseline: bool = True,
    seed: int = 0,
    steps: int | None = None,
    out: Path | None = None,
) -> ChaosResult:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="noloco-chaos-") as tmp:
        base = out or Path(tmp)
        steps = steps or _calibrate(base / "calibration", nodes, model, inner_steps, minutes)
        clean = None
        fault_seconds = minutes * 60
        if baseline:
            clean = _run(
                base / "baseline",
                "baseline",
                nodes,
                model,
                inner_steps,
                steps=steps,
                fault_seconds=0.0,
                kill_every=kill_every,
                rng=None,
            )
            fault_seconds = clean.seconds  # faults for as long as the clean run took
        chaos = _run(
            base / "chaos",
            "chaos",
            nodes,
            model,
            inner_steps,
            steps=steps,
            fault_seconds=fault_seconds,
            kill_every=kill_every,
            rng=rng,
        )
        result = ChaosResult(chaos, clean)
        if out is not None:
            (out / "chaos.json").write_text(json.dumps(result.to_json(), indent=2))
        return result
