"""`noloco-node bench outsider`: a local swarm trains with one outsider doing every attack at once, against the same
swarm without it, in the same run.

Two runs of the same swarm (same nodes, model, data, seed and inner steps):

1. without the outsider;
2. with it: from its own address and at the lowest CPU priority (bench/outsider.py: on shared cores it stands for
   a host of its own), it holds the pairing round with valid manifests followed by silence, opens ten silent
   streams per node, sends payloads in honest peers' names, runs the norm-bound ratchet with random and scaled
   weights, holds 200 idle TCP connections per node and, through a signed DHT record, offers a random state as
   the run's outer step 1,000,000; two more keys on another address offer the honest nodes' own weights with
   poisoned Adam moments as the same step (a "corroborated" front); and a flood of fresh keys from two more
   addresses (bench/echo_flood.py) answers and calls the honest nodes with their own weights. Halfway through both
   runs one honest node is stopped and restarted from its checkpoint (where a fake donor could capture it).

The report: for each run, the honest nodes' blends per minute and per outer step (with each other, and with the
outsider's keys), their final validation loss at the same inner step, crashes, and whether the restarted node
downloaded a state; then what the outsider and the flood saw.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from noloco_bench.outsider import FakeDonor, targets_from_status_files
from noloco_node.config.models import model_config_for
from noloco_node.launcher.local_swarm import LocalSwarm


@dataclass
class SwarmRun:
    label: str
    seconds: float = 0.0
    outer_steps: int = 0
    blends: int = 0
    honest_blends: int = 0  # with another honest node (the rest were with the outsider's keys)
    final_val_losses: list[float] = field(default_factory=list)
    crashes: list[int] = field(default_factory=list)
    restart: str = "not restarted"  # what the node restarted halfway did: resumed, or downloaded (from whom)
    outsider: dict[str, Any] = field(default_factory=dict)
    flood: dict[str, Any] = field(default_factory=dict)

    @property
    def blends_per_minute(self) -> float:
        return 60 * self.blends / self.seconds if self.seconds else math.nan

    @property
    def mean_val_loss(self) -> float:
        return statistics.mean(self.final_val_losses) if self.final_val_losses else math.nan

    def line(self) -> str:
        return (
            f"{self.label:>16}: {self.seconds:6.1f} s, {self.blends:4d} blends in {self.outer_steps:4d} outer steps "
            f"({self.blends_per_minute:6.1f}/min, {self.blends / max(1, self.outer_steps):.0%} of steps; with honest "
            f"nodes {self.honest_blends / max(1, self.outer_steps):.0%}), final val "
            f"loss {self.mean_val_loss:.4f}, crashes {len(self.crashes)}; the node restarted halfway {self.restart}"
        )


@dataclass
class OutsiderBenchResult:
    quiet: SwarmRun
    attacked: SwarmRun

    def report(self) -> str:
        rate = self.attacked.blends_per_minute / self.quiet.blends_per_minute
        honest = (self.attacked.honest_blends / max(1, self.attacked.outer_steps)) / max(
            1e-9, self.quiet.honest_blends / max(1, self.quiet.outer_steps)
        )
        loss = self.attacked.mean_val_loss / self.quiet.mean_val_loss - 1
        return "\n".join(
            [
                self.quiet.line(),
                self.attacked.line(),
                f"with the outsider: {rate:.0%} of the blend rate (target >= 80%), {honest:.0%} of the honest-honest "
                f"blends per outer step (target >= 70%), final val loss {loss:+.2%} (target within 5%)",
                f"the outsider saw: {json.dumps(self.attacked.outsider, sort_keys=True)}",
                f"the fresh-key flood: {json.dumps(self.attacked.flood.get('report', {}), sort_keys=True)}",
            ]
        )


def _node_args(model: str, steps: int, inner_steps: int) -> list[str]:
    return [
        *("--model", model, "--seq-len", "64", "--steps", str(steps), "--inner-steps", str(inner_steps)),
        *("--eval-batches", "4", "--pair-timeout", "5", "--record-ttl", "10", "--log-every", "30"),
        *("--checkpoint-every", "1"),
        # Standing scaled to the bench's minute-long runs (the default, 120 s, is a few outer steps of a big model):
        # here about 25 outer steps of the tiny model.
        *("--standing-seconds", "10"),
    ]


def _run(base: Path, label: str, nodes: int, model: str, steps: int, inner_steps: int, attack: bool) -> SwarmRun:
    run = SwarmRun(label)
    swarm = LocalSwarm(base, nodes, _node_args(model, steps, inner_steps))
    donors: list[FakeDonor] = []
    outsider: subprocess.Popen[str] | None = None
    flood: subprocess.Popen[str] | None = None
    started = time.monotonic()
    try:
        first = _wait(lambda: all((swarm.status(s) or {}).get("outer_step", 0) >= 1 for s in swarm.slots), 300)
        if not first:
            raise RuntimeError(f"the swarm did not start; see the node logs in {base}")
        if attack:
            status = swarm.status(swarm.slots[0]) or {}
            model_cfg = model_config_for(model, vocab_size=256, max_seq_len=64)
            donors.append(FakeDonor(swarm.maddrs, status["run_fingerprint"], model_cfg))
            honest = targets_from_status_files([s.data_dir for s in swarm.slots])
            donors += [
                FakeDonor(
                    swarm.maddrs,
                    status["run_fingerprint"],
                    model_cfg,
                    host="127.0.0.3",
                    honest=lambda: next(iter(honest()), None),
                    inner_steps=inner_steps,
                )
                for _ in range(2)
            ]
            flood = subprocess.Popen(
                [
                    sys.executable,
                    *("-m", "noloco_bench.echo_flood", "--model", model, "--seconds", "600"),
                    *("--hosts", "127.0.0.4,127.0.0.5", "--key-life", "12"),
                    *(item for s in swarm.slots for item in ("--data-dir", str(s.data_dir))),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            outsider = subprocess.Popen(
                [
                    sys.executable,
                    *("-m", "noloco_bench.outsider", "--model", model, "--seconds", "100000"),
                    *(item for s in swarm.slots for item in ("--data-dir", str(s.data_dir))),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        restarted = False
        while swarm.running():
            time.sleep(0.5)
            swarm.poll()
            victim = swarm.slots[-1]
            progress = [(swarm.status(s) or {}).get("inner_step", 0) for s in swarm.slots]
            if not restarted and progress[-1] >= steps // 2 and victim.process and victim.process.poll() is None:
                victim.process.terminate()  # a graceful stop: it checkpoints, then comes back on its data dir
                victim.process.wait(60)
                swarm.start(victim)
                restarted = True
            if outsider is not None and max(progress) >= steps - inner_steps:
                run.outsider = _stop(outsider)  # while every node still trains: its probes measure live nodes
                outsider = None
            if flood is not None and max(progress) >= steps - inner_steps:
                run.flood = _stop(flood)
                flood = None
        run.seconds = time.monotonic() - started
    finally:
        if outsider is not None:
            run.outsider = _stop(outsider)
        if flood is not None:
            run.flood = _stop(flood)
        for donor in donors:
            donor.close()
        swarm.stop()
    honest_ids = {(swarm.status(slot) or {}).get("peer_id") for slot in swarm.slots}
    for slot in swarm.slots:
        history = [h for h in (swarm.status(slot) or {}).get("history", []) if h["inner_step"] <= steps]
        run.outer_steps += len(history)
        run.blends += sum(1 for h in history if h["partner"])
        run.honest_blends += sum(1 for h in history if h["partner"] in honest_ids)
        if history:
            run.final_val_losses.append(history[-1]["val_loss"])
        run.crashes += slot.crashes
    victim = swarm.slots[-1]
    if victim.lives > 1:
        log = (base / f"node{victim.index}.life{victim.lives}.log").read_text()
        if "joined a run in progress: state of outer step" in log:
            source = log.split("joined a run in progress: state of outer step")[1].split()[2]
            fake = any(donor.identity.peer_id.endswith(source) for donor in donors)
            run.restart = f"downloaded a state from {'A FAKE DONOR' if fake else 'an honest peer'}"
        else:
            run.restart = "resumed its checkpoint"
    return run


def _stop(attacker: subprocess.Popen[str]) -> dict[str, Any]:
    """Stop an attacking process (it stops its attacks and prints what it saw, as JSON)."""
    attacker.terminate()
    try:
        # At the lowest CPU priority on cores the nodes keep busy, its wind-down can take minutes.
        stdout, _ = attacker.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        attacker.kill()
        attacker.communicate()
        return {"report": "killed: it did not stop within 300 s"}
    lines = stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else {}


def _wait(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.5)
    return False


def run_outsider_bench(*, nodes: int, model: str, steps: int, inner_steps: int, out: Path) -> OutsiderBenchResult:
    quiet = _run(out / "quiet", "without outsider", nodes, model, steps, inner_steps, attack=False)
    attacked = _run(out / "attacked", "with outsider", nodes, model, steps, inner_steps, attack=True)
    return OutsiderBenchResult(quiet, attacked)
