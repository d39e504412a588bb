"""`noloco-node bench stragglers`: what a global barrier costs when step times vary, measured side by side.

Every inner step of every replica takes a mean time T times a log-normal factor of spread sigma (mean 1), the
straggler model of the paper's simulation (arXiv 2506.10911, section 5). Three runs of N replicas training the same
S inner steps of the same model, each with its own draws:

- a real local swarm in ``sync`` mode (a node waits for a partner at its outer step, at most pair_timeout);
- the same in ``overlap`` mode (no waiting: the exchange runs behind the next phase);
- DiLoCo's global barrier (diloco_worker.py): N gloo processes that run DiLoCo's outer step (an all-reduce) every
  H steps, so each outer step waits for the slowest replica.

The figure is each run's inner steps per second per replica (start-up excluded), next to 1/T, the rate with no
waiting at all, and the barrier's expected rate from the same distribution (a Monte-Carlo estimate of
E[max over N replicas of a phase's summed step times]).
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from noloco_node.launcher.local_swarm import LocalSwarm, steps_per_second
from noloco_node.node.fault_injection import Drill


@dataclass
class StragglersResult:
    nodes: int
    steps: int
    inner_steps: int
    step_seconds: float
    sigma: float
    rates: dict[str, list[float]] = field(default_factory=dict)  # run -> inner steps/s of each replica
    waited: dict[str, float] = field(default_factory=dict)  # run -> mean fraction of time waiting

    def barrier_model_rate(self, samples: int = 4000) -> float:
        """Inner steps/s per replica behind a barrier every H steps, from the step-time distribution alone."""
        rng = np.random.default_rng(0)
        sigma = self.sigma
        phases = rng.lognormal(-sigma * sigma / 2, sigma, size=(samples, self.nodes, self.inner_steps)).sum(axis=2)
        return self.inner_steps / (self.step_seconds * float(phases.max(axis=1).mean()))

    def report(self) -> str:
        ideal = 1 / self.step_seconds
        lines = [
            f"{self.nodes} replicas, {self.steps} inner steps, H = {self.inner_steps}, step time "
            f"{self.step_seconds:g} s x log-normal(sigma {self.sigma:g}, mean 1)",
            "| run | inner steps/s per replica | of the no-wait rate | time waiting |",
            "|---|---:|---:|---:|",
        ]
        for name, rates in self.rates.items():
            mean = statistics.fmean(rates)
            lines.append(
                f"| {name} | {mean:.2f} (min {min(rates):.2f}) | {mean / ideal:.1%} | {self.waited.get(name, 0):.1%} |"
            )
        model = self.barrier_model_rate()
        lines.append(f"no-wait rate 1/T = {ideal:.2f}; the barrier's expected rate from the distribution: {model:.2f}")
        if "diloco barrier" in self.rates:
            barrier = statistics.fmean(self.rates["diloco barrier"])
            for mode in [run for run in self.rates if run.startswith("noloco ")]:
                lines.append(f"{mode} / diloco barrier throughput: {statistics.fmean(self.rates[mode]) / barrier:.3f}")
        return "\n".join(lines)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _swarm_run(base: Path, mode: str, result: StragglersResult, model: str) -> tuple[list[float], float]:
    args = ["--model", model, "--steps", str(result.steps), "--inner-steps", str(result.inner_steps),
            "--eval-batches", "1", "--log-every", "30", "--mode", mode, "--pair-timeout", "30"]  # fmt: skip
    drill = Drill(step_time_seconds=result.step_seconds, step_time_sigma=result.sigma).environment()
    swarm = LocalSwarm(base, result.nodes, args, per_node_env=[drill] * result.nodes)
    try:
        deadline = time.monotonic() + 3600
        while time.monotonic() < deadline and swarm.running():
            time.sleep(0.5)
    finally:
        swarm.stop()
    statuses = [swarm.status(slot) or {} for slot in swarm.slots]
    rates = [steps_per_second(s.get("history", [])) for s in statuses]
    waited = statistics.fmean(s.get("comm_wait_fraction", 0.0) or 0.0 for s in statuses)
    return rates, waited


def _barrier_run(result: StragglersResult, model: str) -> tuple[list[float], float]:
    port = _free_port()
    common = [
        "--world", str(result.nodes), "--port", str(port), "--model", model, "--steps", str(result.steps),
        "--inner-steps", str(result.inner_steps), "--step-time-seconds", str(result.step_seconds),
        "--step-time-sigma", str(result.sigma),
    ]  # fmt: skip
    command = [sys.executable, "-m", "noloco_bench.diloco_worker", *common]
    workers = [
        subprocess.Popen([*command, "--rank", str(rank)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(result.nodes)
    ]
    outputs = [w.communicate(timeout=3600)[0] for w in workers]
    if any(w.returncode for w in workers):
        raise RuntimeError("a barrier worker failed:\n" + "\n".join(o[-2000:] for o in outputs))
    measured = json.loads(outputs[0].strip().splitlines()[-1])
    rate = result.steps / measured["seconds"]
    return [rate] * result.nodes, measured["barrier_seconds"] / measured["seconds"]


def run_stragglers_bench(
    nodes: int = 4,
    steps: int = 200,
    inner_steps: int = 20,
    step_seconds: float = 0.1,
    sigma: float = 0.5,
    model: str = "tiny",
    modes: tuple[str, ...] = ("sync", "overlap"),
) -> StragglersResult:
    result = StragglersResult(nodes, steps, inner_steps, step_seconds, sigma)
    with tempfile.TemporaryDirectory(prefix="noloco-stragglers-") as tmp:
        for mode in modes:
            rates, waited = _swarm_run(Path(tmp) / mode, mode, result, model)
            result.rates[f"noloco {mode}"], result.waited[f"noloco {mode}"] = rates, waited
    rates, waited = _barrier_run(result, model)
    result.rates["diloco barrier"], result.waited["diloco barrier"] = rates, waited
    return result
