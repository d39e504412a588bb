"""`noloco-node bench straggler`: does one slow node slow the others down?

Two runs of a local swarm, the same N normal nodes training the same S inner steps: alone, and joined by one node
whose every inner step takes ``slow_factor`` times longer (a straggler: its drill, node/fault_injection.py). The
figure is the normal nodes' inner-step throughput with the straggler over without it. With no barrier, a straggler
should cost the others at most the exchanges it cannot answer in time (they pair with each other instead), plus
whatever CPU it takes on a shared machine.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from noloco_node.launcher.local_swarm import LocalSwarm, steps_per_second
from noloco_node.node.fault_injection import Drill


@dataclass
class StragglerResult:
    nodes: int
    slow_factor: float
    alone: list[float] = field(default_factory=list)  # normal nodes' inner steps per second
    with_straggler: list[float] = field(default_factory=list)
    straggler_steps_per_second: float = 0.0
    straggler_catch_ups: int = 0  # states it downloaded after falling out of reach (docs/churn.md)
    blends_with_straggler: int = 0
    normal_blends: int = 0
    normal_outer_steps: int = 0

    @property
    def ratio(self) -> float:
        return statistics.mean(self.with_straggler) / statistics.mean(self.alone)

    def report(self) -> str:
        lines = []
        if self.alone:
            lines.append(f"{self.nodes} normal nodes alone:        {_rates(self.alone)} inner steps/s")
        lines += [
            f"the same with a {self.slow_factor:g}x straggler: {_rates(self.with_straggler)} inner steps/s (the "
            f"straggler: {self.straggler_steps_per_second:.1f}, and {self.straggler_catch_ups} catch-up downloads)",
            f"blends of the normal nodes: {self.normal_blends} in {self.normal_outer_steps} outer steps, of which "
            f"with the straggler: {self.blends_with_straggler}",
        ]
        if self.alone:
            lines.append(f"normal nodes' throughput with / without the straggler: {self.ratio:.3f}")
        return "\n".join(lines)


def _rates(values: list[float]) -> str:
    return ", ".join(f"{v:.1f}" for v in values)


def _run(base: Path, nodes: int, steps: int, model: str, straggler: float | None) -> tuple[list[dict], dict | None]:
    args = ["--model", model, "--steps", str(steps), "--inner-steps", "20", "--eval-batches", "2", "--log-every", "30"]
    drills = [Drill() for _ in range(nodes)]
    if straggler is not None:
        drills.append(Drill(slow_factor=straggler))
    swarm = LocalSwarm(base, len(drills), args, per_node_env=[drill.environment() for drill in drills])
    normal = swarm.slots[:nodes]
    try:
        deadline = time.monotonic() + 1800
        while time.monotonic() < deadline and any(slot in swarm.running() for slot in normal):
            time.sleep(0.5)
    finally:
        swarm.stop()
    statuses = [swarm.status(slot) or {} for slot in swarm.slots]
    return statuses[:nodes], statuses[nodes] if straggler is not None else None


def run_straggler_bench(
    nodes: int, slow_factor: float, steps: int, model: str, *, reference: bool = True
) -> StragglerResult:
    """With ``reference=False`` only the run with the straggler is made: its blends and step rates, but no ratio
    (what a test of the behaviour needs, in half the time)."""
    result = StragglerResult(nodes, slow_factor)
    with tempfile.TemporaryDirectory(prefix="noloco-straggler-") as tmp:
        alone, _ = _run(Path(tmp) / "alone", nodes, steps, model, None) if reference else ([], None)
        joined, slow = _run(Path(tmp) / "straggler", nodes, steps, model, slow_factor)
    result.alone = [steps_per_second(s.get("history", [])) for s in alone]
    result.with_straggler = [steps_per_second(s.get("history", [])) for s in joined]
    if slow:
        result.straggler_steps_per_second = steps_per_second(slow.get("history", []))
        slow_id = slow.get("peer_id")
        result.straggler_catch_ups = int(slow.get("exchange_outcomes", {}).get("state_downloaded", 0))
        result.normal_outer_steps = sum(len(s.get("history", [])) for s in joined)
        partners = [h["partner"] for s in joined for h in s.get("history", []) if h["partner"]]
        result.normal_blends = len(partners)
        result.blends_with_straggler = sum(1 for p in partners if p == slow_id)
    return result
