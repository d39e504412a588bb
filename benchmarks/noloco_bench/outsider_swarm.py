"""`noloco-node bench outsider`: a local swarm trains with one outsider doing every attack at once, against the same
swarm without it, in the same run.

Two runs of the same swarm (same nodes, model, data, seed and inner steps):

1. without the outsider;
2. with it: from its own addresses, on half a core of its own (bench/cpu_group.py: a CPU quota, filled by a
   stand-in busy loop in both runs, so the nodes have the same CPU in both), it holds the pairing round with
   valid manifests followed by silence, opens ten silent streams per node, sends payloads in honest peers'
   names, runs the norm-bound ratchet with random and scaled weights, holds 200 idle TCP connections per node
   and, through a signed DHT record, offers a random state as the run's outer step 1,000,000; two more keys on
   another address offer the honest nodes' own weights with poisoned Adam moments as the same step (a
   "corroborated" front; bench/fake_donors.py); and a flood of fresh keys from two more addresses
   (bench/echo_flood.py) answers and calls the honest nodes with their own weights. Halfway through both
   runs one honest node is stopped and restarted from its checkpoint (where a fake donor could capture it).

With ``--partition-seconds`` (root) both runs take place on a network of namespaces (bench/shaped_network.py, no
added delay): a host per honest node, and one for every attacking process, which speak from five addresses of its
link. A tenth of the way in, the router cuts the honest nodes into two halves for that long (the attackers reach
both), then heals: the report adds how many outer steps each node took from the heal to its first blend across
the old split, and counts quarantines (drift is not hostility: none is expected).

The report: for each run, the honest nodes' blends per minute and per outer step (with each other, and with the
outsider's keys), their final validation loss at the same inner step, crashes, and whether the restarted node
downloaded a state, and after a partition the outer steps to merge again and the quarantines; then what the
outsider and the flood saw.
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from noloco_bench.cpu_group import CpuGroup, outsider_cpu
from noloco_bench.shaped_network import ShapedNetwork, shaped_network
from noloco_node.launcher.local_swarm import LocalSwarm

EXIT_GRACE_SECONDS = 120.0  # a node that trained its last step has left well within this


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
    hung_exits: int = 0  # nodes still running EXIT_GRACE_SECONDS after every node trained its last step
    quarantines: int = 0  # honest peers quarantined by honest nodes (quarantine is for what no honest peer sends)
    # per node: outer steps and seconds from the heal to its first blend across the old split (None: never)
    merged_after: list[tuple[int, float] | None] = field(default_factory=list)

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
            + (
                f"; after the heal, outer steps (and seconds) to each node's first blend across the split: "
                f"{', '.join('never' if m is None else f'{m[0]} ({m[1]:g} s)' for m in self.merged_after)} "
                f"(target <= 5 steps)"
                if self.merged_after
                else ""
            )
            + f"; honest peers quarantined {self.quarantines}"
            + (f"; NODES THAT DID NOT EXIT after their last step: {self.hung_exits}" if self.hung_exits else "")
        )


@dataclass(frozen=True)
class SwarmShape:
    """The swarm both runs train: ``nodes`` honest nodes, ``steps`` inner steps each at H = ``inner_steps``; with
    ``partition_seconds``, cut into ``halves`` (node indices) for that long once every node is a tenth of the way."""

    nodes: int
    model: str
    steps: int
    inner_steps: int
    partition_seconds: float = 0.0

    @property
    def halves(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        first = tuple(range(self.nodes // 2))
        return first, tuple(range(len(first), self.nodes))


@dataclass
class OutsiderBenchResult:
    quiet: SwarmRun
    attacked: SwarmRun
    cpu: str = ""  # how the attackers' CPU was kept apart from the nodes' (bench/cpu_group.py)

    def report(self) -> str:
        rate = self.attacked.blends_per_minute / self.quiet.blends_per_minute
        honest = (self.attacked.honest_blends / max(1, self.attacked.outer_steps)) / max(
            1e-9, self.quiet.honest_blends / max(1, self.quiet.outer_steps)
        )
        loss = self.attacked.mean_val_loss / self.quiet.mean_val_loss - 1
        return "\n".join(
            [
                *([self.cpu] if self.cpu else []),
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


@dataclass(frozen=True)
class Placement:
    """Where the attacking processes run and which addresses they speak from: on 127.0.0.1 beside the swarm
    (loopback addresses of their own), or on a host of the shaped network of their own, a few addresses on its link
    (``exec_prefix`` runs a command there)."""

    exec_prefix: tuple[str, ...] = ()
    outsider: str = "127.0.0.2"  # hogs, silent streams, idle connections
    payloads: str = "127.0.0.3"  # forged, ratchet, random and scaled payloads
    flood: tuple[str, ...] = ("127.0.0.4", "127.0.0.5")
    random_donor: str = "127.0.0.1"
    poisoned_donors: str = "127.0.0.3"


def _attackers(
    swarm: LocalSwarm, placement: Placement, model: str, inner_steps: int, cpu: CpuGroup
) -> dict[str, subprocess.Popen[str]]:
    """Start the three attacking processes (the outsider, the fake donors, the fresh-key flood), each at the lowest
    CPU priority and together in the CPU group of the outsider's host (bench/cpu_group.py)."""
    data_dirs = [item for s in swarm.slots for item in ("--data-dir", str(s.data_dir))]
    commands = {
        "donors": [
            *("-m", "noloco_bench.fake_donors", "--model", model, "--inner-steps", str(inner_steps)),
            *("--random-host", placement.random_donor, "--poisoned-host", placement.poisoned_donors),
            *(item for maddr in swarm.maddrs for item in ("--initial-peer", maddr)),
        ],
        "flood": [
            # --seconds sizes its key ring (a key every 3 s, all made before it starts): it is stopped long before
            *("-m", "noloco_bench.echo_flood", "--model", model, "--seconds", "900"),
            *("--hosts", ",".join(placement.flood), "--key-life", "12"),
        ],
        "outsider": [
            *("-m", "noloco_bench.outsider", "--model", model, "--seconds", "100000"),
            *("--source", placement.outsider, "--payload-source", placement.payloads),
        ],
    }
    return {
        name: subprocess.Popen(
            [*cpu.prefix, *placement.exec_prefix, sys.executable, *command, *data_dirs],
            stdout=subprocess.PIPE,
            stderr=(swarm.base / f"{name}.log").open("w"),  # the child holds its own descriptor
            text=True,
        )
        for name, command in commands.items()
    }


def _run(
    base: Path,
    label: str,
    shape: SwarmShape,
    *,
    attack: bool,
    network: ShapedNetwork | None = None,
    placement: Placement = Placement(),
    cpu: CpuGroup,
) -> SwarmRun:
    run = SwarmRun(label)
    steps, inner_steps = shape.steps, shape.inner_steps
    swarm = LocalSwarm(base, shape.nodes, _node_args(shape.model, steps, inner_steps), network=network)
    attackers: dict[str, subprocess.Popen[str]] = {}
    stopping = False
    stand_in: subprocess.Popen[bytes] | None = None
    partition: contextlib.AbstractContextManager[None] | None = None
    split = healed = 0.0
    started = time.monotonic()
    try:
        first = _wait(lambda: all((swarm.status(s) or {}).get("outer_step", 0) >= 1 for s in swarm.slots), 300)
        if not first:
            raise RuntimeError(f"the swarm did not start; see the node logs in {base}")
        stand_in = cpu.stand_in()  # in both runs: the nodes get the same CPU with and without the outsider
        if attack:
            attackers = _attackers(swarm, placement, shape.model, inner_steps, cpu)
        restarted = False
        finished_at: float | None = None
        while swarm.running():
            time.sleep(0.5)
            swarm.poll()
            victim = swarm.slots[-1]
            progress = [(swarm.status(s) or {}).get("inner_step", 0) for s in swarm.slots]
            if min(progress) >= steps:
                finished_at = finished_at or time.monotonic()
                if time.monotonic() - finished_at > EXIT_GRACE_SECONDS:
                    # Seen once: a node that had trained every step never exited, its exchange thread blocked in
                    # gRPC's response iterator, joined at interpreter exit. Counted, and stopped below.
                    run.hung_exits = len(swarm.running())
                    break
            if network is not None and shape.partition_seconds and not split and min(progress) >= steps // 10:
                partition = network.partition(*shape.halves)
                partition.__enter__()
                split = time.time()
            if partition is not None and time.time() - split >= shape.partition_seconds:
                partition.__exit__(None, None, None)
                partition, healed = None, time.time()
            apart = partition is not None
            alive = victim.process is not None and victim.process.poll() is None
            if not restarted and not apart and progress[-1] >= steps // 2 and alive:
                assert victim.process is not None
                victim.process.terminate()  # a graceful stop: it checkpoints, then comes back on its data dir
                victim.process.wait(60)
                swarm.start(victim)
                restarted = True
            if attackers and not stopping and max(progress) >= steps - inner_steps:
                # Told to stop while every node still trains (the outsider's probes measure live nodes); their
                # reports are read once the swarm is done, so that their wind-down is not the nodes' time.
                for process in attackers.values():
                    process.terminate()
                stopping = True
        run.seconds = time.monotonic() - started
    finally:
        if partition is not None:
            partition.__exit__(None, None, None)
        reports = {name: _stop(process) for name, process in attackers.items()}
        if stand_in is not None:
            stand_in.kill()
            stand_in.wait()
        swarm.stop()
    run.outsider, run.flood = reports.get("outsider", {}), reports.get("flood", {})
    statuses = [swarm.status(slot) or {} for slot in swarm.slots]
    honest_ids = {status.get("peer_id") for status in statuses}
    half_of = {statuses[i].get("peer_id"): h for h, half in enumerate(shape.halves) for i in half}
    for slot, status in zip(swarm.slots, statuses, strict=True):
        history = [h for h in status.get("history", []) if h["inner_step"] <= steps]
        run.outer_steps += len(history)
        run.blends += sum(1 for h in history if h["partner"])
        run.honest_blends += sum(1 for h in history if h["partner"] in honest_ids)
        if history:
            run.final_val_losses.append(history[-1]["val_loss"])
        run.crashes += slot.crashes
        # Quarantines of honest peers only: the outsider's keys are quarantined for what they send, as they should.
        run.quarantines += sum(
            1
            for line in swarm.logs(slot).splitlines()
            if "quarantined for" in line and any(f"from {peer_id}" in line for peer_id in honest_ids if peer_id)
        )
        if healed:
            run.merged_after.append(steps_to_merge(history, healed, half_of, status.get("peer_id")))
    victim = swarm.slots[-1]
    if victim.lives > 1:
        log = (base / f"node{victim.index}.life{victim.lives}.log").read_text()
        if "joined a run in progress: state of outer step" in log:
            source = log.split("joined a run in progress: state of outer step")[1].split()[2]
            fake = any(peer_id.endswith(source) for peer_id in reports.get("donors", {}).get("peer_ids", []))
            run.restart = f"downloaded a state from {'A FAKE DONOR' if fake else 'an honest peer'}"
        else:
            run.restart = "resumed its checkpoint"
    return run


def steps_to_merge(
    history: list[dict[str, Any]], healed: float, half_of: dict[str | None, int], peer_id: str | None
) -> tuple[int, float] | None:
    """A node's outer steps after the heal up to its first blend with a node of the other half (counted as steps
    taken: a half that was behind moves its clock, and its step numbers jump), and the seconds; None if never."""
    after = [h for h in history if h["time"] > healed]
    return next(
        (
            (taken, round(h["time"] - healed, 1))
            for taken, h in enumerate(after, start=1)
            if h["partner"] in half_of and half_of[h["partner"]] != half_of.get(peer_id)
        ),
        None,
    )


def _stop(attacker: subprocess.Popen[str]) -> dict[str, Any]:
    """Stop an attacking process (it stops its attacks and prints what it saw, as JSON)."""
    attacker.terminate()
    try:
        stdout, _ = attacker.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        attacker.kill()
        attacker.communicate()
        return {"report": "killed: it did not stop within 120 s"}
    lines = stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else {}


def _wait(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.5)
    return False


def run_outsider_bench(shape: SwarmShape, *, out: Path) -> OutsiderBenchResult:
    """Both runs. With ``shape.partition_seconds`` the swarm runs in network namespaces (root), one host per node
    and one for the attackers, and both runs are cut into ``shape.halves`` for that long (the attackers reach both
    halves); without, on 127.0.0.1."""
    with contextlib.ExitStack() as stack:
        cpu = stack.enter_context(outsider_cpu())
        net: ShapedNetwork | None = None
        placement = Placement()
        if shape.partition_seconds:
            net = stack.enter_context(shaped_network(shape.nodes + 1, rate_mbit=1000, rtt_ms=0, prefix="nlout"))
            host = shape.nodes  # the attackers' host: its main address and four more on its link
            main, payloads, flood_a, flood_b, donors = net.address(host), *net.add_addresses(host, 4)
            placement = Placement(tuple(net.exec_prefix(host)), main, payloads, (flood_a, flood_b), main, donors)
        quiet = _run(out / "quiet", "without outsider", shape, attack=False, network=net, cpu=cpu)
        attacked = _run(
            out / "attacked", "with outsider", shape, attack=True, network=net, placement=placement, cpu=cpu
        )
    return OutsiderBenchResult(quiet, attacked, cpu.describe)
