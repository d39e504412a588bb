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
   "corroborated" front; bench/fake_donors.py); two more keys on two more addresses offer the honest nodes' own
   weights as that step (the counters donors: a front that measures well, whose counters would end an adopter);
   a flood of fresh keys from two more addresses (bench/echo_flood.py) answers and calls the honest nodes with
   their own weights; and a patient Sybil keeps 16 keys on eight more addresses past the standing period, half of
   them advertised under other spellings of their IP, and on a network of namespaces 8 keys more on eight IPv6
   addresses, each in another /64 of the attackers' one /48. A third of the way through both runs the first honest
   node is killed and a newcomer takes its place (a joiner, with an empty data directory); halfway, the last one
   is stopped and restarted from its checkpoint (where a fake donor could capture either).

With ``--namespaces`` or ``--partition-seconds`` (root) both runs take place on a network of namespaces
(bench/shaped_network.py, no added delay) whose addresses are public as far as the nodes can tell (100.81.0.0/16,
carrier-grade NAT space no internet router forwards): a host, and so a /24 network group, per honest node, and one
for every attacking process, which speak from fourteen addresses of its one /24, as an outsider with an address
range does, and from eight IPv6 addresses, each in another /64 of the host's one /48 (2a0d:81:N::/48, global unicast
space that never leaves the namespaces; the nodes announce IPv4 and listen on IPv6 too, where these keys call in).
On 127.0.0.1 instead every loopback address is a group of its own (noloco_node/addresses.py), the
honest nodes share one and the attackers hold thirteen. With ``--partition-seconds``, a tenth of the way in, the
router cuts the honest nodes into two halves for that long (the attackers reach both), then heals: the report adds
how many outer steps each node took from the heal to its first blend across the old split, and counts quarantines
(drift is not hostility: none is expected).

The report: for each run, the honest nodes' blends per minute and per outer step (with each other, and with the
outsider's keys), the attackers' share of the blends next to their share of the network groups, the final
validation loss at the same inner step, crashes, what the joiner and the restarted node downloaded and whether
they trained to the end, and after a partition the outer steps to merge again and the quarantines; then what the
outsider, the flood and the patient Sybil saw.
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
from noloco_bench.outsider import STREAM_ATTACKS
from noloco_bench.shaped_network import ShapedNetwork, shaped_network
from noloco_node.addresses import host_of_address, network_group
from noloco_node.launcher.local_swarm import LocalSwarm, NodeSlot, join_command

EXIT_GRACE_SECONDS = 120.0  # a node that trained its last step has left well within this
# The namespaces' addresses: carrier-grade NAT space (RFC 6598), which no internet router forwards but which
# noloco_node/addresses.py weighs as public (a /24 per group), so each host is a network group as on the internet;
# and IPv6 global unicast space (a /48 per host), which never leaves the namespaces.
PUBLIC_SUBNET = "100.81"
PUBLIC_SUBNET6 = "2a0d:81"
SYBIL_KEYS = 16  # on the Sybil's IPv4 addresses; one more per IPv6 address
# A stream run's turncoat trains honestly this long from the attack's start (its standing: a few stranger turns and
# --standing-seconds, 10 s here), then shrinks its partners' weights for the rest of the run (about 150 s).
TURNCOAT_HONEST_SECONDS = 45.0


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
    joiner: str = "no joiner"  # what the newcomer a third of the way in downloaded, and whether it finished
    honest_groups: set[str] = field(default_factory=set)  # the network groups of the honest nodes' addresses
    attacker_groups: set[str] = field(default_factory=set)  # ... and of every address an attacker speaks from
    outsider: dict[str, Any] = field(default_factory=dict)
    flood: dict[str, Any] = field(default_factory=dict)
    sybil: dict[str, Any] = field(default_factory=dict)
    turncoat: dict[str, Any] = field(default_factory=dict)
    turncoat_blends: int = 0  # the honest nodes' blends with the turncoat's key (while honest and after)
    hung_exits: int = 0  # nodes still running EXIT_GRACE_SECONDS after every node trained its last step
    quarantines: int = 0  # honest peers quarantined by honest nodes (quarantine is for what no honest peer sends)
    # per node: outer steps and seconds from the heal to its first blend across the old split (None: never)
    merged_after: list[tuple[int, float] | None] = field(default_factory=list)
    sybil6_keys: int = 0  # the patient Sybil's keys on IPv6 addresses of its one /48 (a network of namespaces)
    sybil6_blends: int = 0  # the honest nodes' blends with them
    # per node (its last life): outer steps blended with an honest node, of the outer steps it took
    node_honest: list[tuple[int, int]] = field(default_factory=list)

    @property
    def blends_per_minute(self) -> float:
        return 60 * self.blends / self.seconds if self.seconds else math.nan

    @property
    def attacker_share(self) -> float:
        """The share of the honest nodes' blends that went to an attacker's key."""
        return (self.blends - self.honest_blends) / self.blends if self.blends else 0.0

    @property
    def attacker_group_share(self) -> float:
        """The attackers' share of the network groups the honest nodes could pair with."""
        groups = self.honest_groups | self.attacker_groups
        return len(self.attacker_groups - self.honest_groups) / len(groups) if groups else 0.0

    @property
    def mean_val_loss(self) -> float:
        return statistics.mean(self.final_val_losses) if self.final_val_losses else math.nan

    def line(self) -> str:
        return (
            f"{self.label:>16}: {self.seconds:6.1f} s, {self.blends:4d} blends in {self.outer_steps:4d} outer steps "
            f"({self.blends_per_minute:6.1f}/min, {self.blends / max(1, self.outer_steps):.0%} of steps; with honest "
            f"nodes {self.honest_blends / max(1, self.outer_steps):.0%}"
            + (
                f"; attackers' keys {self.attacker_share:.0%} of blends with {self.attacker_group_share:.0%} of the "
                f"network groups"
                if self.attacker_groups
                else ""
            )
            + (
                f", of which {self.sybil6_blends} with the Sybil's {self.sybil6_keys} keys on IPv6 networks of one /48"
                if self.sybil6_keys
                else ""
            )
            + "; per node with honest nodes "
            + ", ".join(f"{honest}/{taken}" for honest, taken in self.node_honest)
            + f"), final val loss {self.mean_val_loss:.4f}, crashes {len(self.crashes)}; the joiner {self.joiner}; "
            f"the node restarted halfway {self.restart}"
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
    namespaces: bool = False  # on a network of namespaces even without a partition
    mode: str = "sync"  # the pairing mode; "stream" takes the stream attacks instead of the sync ones
    wire_dtype: str | None = None  # the run's wire dtype (None: the mode's default)

    @property
    def on_network(self) -> bool:
        return self.namespaces or self.partition_seconds > 0

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
                f"with the outsider: attackers' keys took {self.attacked.attacker_share:.0%} of the blends with "
                f"{self.attacked.attacker_group_share:.0%} of the network groups (target: no more than that share)",
                f"the outsider saw: {json.dumps(self.attacked.outsider, sort_keys=True)}",
                *(
                    [f"the fresh-key flood: {json.dumps(self.attacked.flood.get('report', {}), sort_keys=True)}"]
                    if self.attacked.flood
                    else []
                ),
                *(
                    [f"the patient Sybil: {json.dumps(self.attacked.sybil.get('report', {}), sort_keys=True)}"]
                    if self.attacked.sybil
                    else []
                ),
                *(
                    [
                        f"the turncoat (honest for {TURNCOAT_HONEST_SECONDS:g} s): {self.attacked.turncoat_blends} "
                        f"blends with honest nodes; it saw {json.dumps(self.attacked.turncoat, sort_keys=True)}"
                    ]
                    if self.attacked.turncoat
                    else []
                ),
            ]
        )


def _node_args(shape: SwarmShape) -> list[str]:
    model, steps, inner_steps = shape.model, shape.steps, shape.inner_steps
    return [
        *("--mode", shape.mode),
        *(("--wire-dtype", shape.wire_dtype) if shape.wire_dtype else ()),
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
    poisoned_donors: tuple[str, ...] = ("127.0.0.3", "127.0.0.6")
    sybil: tuple[str, ...] = tuple(f"127.0.0.{7 + k}" for k in range(8))
    sybil6: tuple[str, ...] = ()  # the Sybil's IPv6 addresses (a network of namespaces only)
    # The honest nodes' IPv4 address -> IPv6 address, where the Sybil's IPv6 keys call them (namespaces only).
    honest6: tuple[tuple[str, str], ...] = ()

    @property
    def addresses(self) -> set[str]:
        attackers = {self.outsider, self.payloads, *self.flood, self.random_donor, *self.poisoned_donors}
        return attackers | {*self.sybil, *self.sybil6}

    @property
    def turncoat(self) -> str:
        """The turncoat's address (a stream run has no flood: it takes the flood's first)."""
        return self.flood[0]

    def used_by(self, mode: str) -> set[str]:
        """The addresses the attackers speak from in a run of ``mode``: a stream run has no flood and no Sybil, and
        has the turncoat."""
        if mode == "stream":
            return {self.outsider, self.payloads, self.random_donor, *self.poisoned_donors, self.turncoat}
        return self.addresses


def _attackers(
    swarm: LocalSwarm, placement: Placement, shape: SwarmShape, cpu: CpuGroup
) -> dict[str, subprocess.Popen[str]]:
    """Start the four attacking processes (the outsider, the fake donors, the fresh-key flood, the patient Sybil),
    each at the lowest CPU priority and together in the CPU group of the outsider's host (bench/cpu_group.py). A
    stream run gets the outsider's stream attacks (a key per node that reserves its phases, and one that delivers
    progress shrinking its weights) and the fake donors: the hog, the forged and ratchet payloads, the flood and
    the Sybil speak sync mode's payload, which a stream node refuses unread, and the silent streams and idle
    connections, which the sync run measures, would have the attackers' addresses barred and hide what the stream
    attacks do."""
    model, inner_steps = shape.model, shape.inner_steps
    data_dirs = [item for s in swarm.slots for item in ("--data-dir", str(s.data_dir))]
    bootstrap = [item for maddr in swarm.maddrs for item in ("--initial-peer", maddr)]
    commands = {
        "donors": [
            *("-m", "noloco_bench.fake_donors", "--model", model, "--inner-steps", str(inner_steps)),
            *("--random-host", placement.random_donor, "--poisoned-host", ",".join(placement.poisoned_donors)),
            *bootstrap,
        ],
        "flood": [
            # --seconds sizes its key ring (a key every 3 s, all made before it starts): it is stopped long before
            *("-m", "noloco_bench.echo_flood", "--model", model, "--seconds", "900"),
            *("--hosts", ",".join(placement.flood), "--key-life", "12", *bootstrap),
        ],
        "sybil": [
            # Two keys per IPv4 address and one per IPv6 address, all made at once and kept: they stay far past
            # --standing-seconds (10 s here). Keys go to the hosts in turn: the IPv6 ones after two rounds.
            *("-m", "noloco_bench.echo_flood", "--model", model, "--seconds", "900"),
            *("--keys", str(SYBIL_KEYS + len(placement.sybil6))),
            *("--hosts", ",".join(_sybil_hosts(placement)), "--key-every", "0.5", "--key-life", "100000"),
            *("--spellings", "--ipv6-of", ",".join(f"{v4}={v6}" for v4, v6 in placement.honest6)),
            *bootstrap,
        ],
        "outsider": [
            *("-m", "noloco_bench.outsider", "--model", model, "--seconds", "100000"),
            *("--source", placement.outsider, "--payload-source", placement.payloads),
            *(("--attacks", ",".join(STREAM_ATTACKS)) if shape.mode == "stream" else ()),
            *(("--wire-dtype", shape.wire_dtype) if shape.wire_dtype else ()),
        ],
    }
    if shape.mode == "stream":
        del commands["flood"], commands["sybil"]
    commands = {name: [*command, *data_dirs] for name, command in commands.items()}
    if shape.mode == "stream":
        commands["turncoat"] = _turncoat_command(swarm, placement, shape)
    return {
        name: subprocess.Popen(
            [*cpu.prefix, *placement.exec_prefix, sys.executable, *command],
            stdout=subprocess.PIPE,
            stderr=(swarm.base / f"{name}.log").open("w"),  # the child holds its own descriptor
            text=True,
        )
        for name, command in commands.items()
    }


def _turncoat_command(swarm: LocalSwarm, placement: Placement, shape: SwarmShape) -> list[str]:
    """A member of the swarm (noloco_bench/turncoat.py) that trains and blends honestly, earns standing with the
    honest nodes, and after TURNCOAT_HONEST_SECONDS sends progress shrinking its partners' weights."""
    address = placement.turncoat
    node = join_command(
        swarm.maddrs,
        swarm.base / "turncoat",
        *("--shard-index", "0", "--num-shards", str(shape.nodes)),
        *("--grpc-host", address, "--dht-host-maddrs", f"/ip4/{address}/tcp/0"),
        # Peers dial it at that address, but its own calls leave from its host's main address, which the
        # reachability check reads as a NAT: it would be reached only through relays (and in one run never was).
        "--no-check-reachability",
        *_node_args(shape),
    )
    assert node[1:3] == ["-m", "noloco_node"], node
    return ["-m", "noloco_bench.turncoat", "--honest-seconds", str(TURNCOAT_HONEST_SECONDS), "--", *node[3:]]


def _sybil_hosts(placement: Placement) -> list[str]:
    """The Sybil's hosts in the order its keys take them (echo_flood.py: key k on host k modulo their number): each
    IPv4 address twice, then each IPv6 address once."""
    per_address = SYBIL_KEYS // len(placement.sybil)
    return [*(placement.sybil * per_address), *placement.sybil6]


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
    # On a network with IPv6, the nodes announce their IPv4 address and listen on both (as a dual-stack host does):
    # the Sybil's IPv6 keys call in from their networks.
    dual_stack = (
        [["--grpc-host", "[::]", "--announce-host", network.address(i)] for i in range(shape.nodes)]
        if network is not None and network.subnet6 is not None
        else None
    )
    swarm = LocalSwarm(base, shape.nodes, _node_args(shape), dual_stack, network=network)
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
            attackers = _attackers(swarm, placement, shape, cpu)
        restarted = joined = False
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
            newcomer = swarm.slots[0]
            if not joined and not apart and progress[0] >= steps // 3 and newcomer.process is not None:
                swarm.kill(newcomer)  # gone for good; a newcomer with an empty data dir takes its place
                swarm.replace(newcomer)
                joined = True
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
    run.outsider, run.flood, run.sybil, run.turncoat = (
        reports.get(name, {}) for name in ("outsider", "flood", "sybil", "turncoat")
    )
    statuses = [swarm.status(slot) or {} for slot in swarm.slots]
    honest_ids = {status.get("peer_id") for status in statuses} | _first_lives_ids(swarm)
    run.honest_groups = {network_group(host_of_address(s["address"])) for s in statuses if s.get("address")}
    if attack:
        run.attacker_groups = {network_group(address) for address in placement.used_by(shape.mode)}
    half_of = {statuses[i].get("peer_id"): h for h, half in enumerate(shape.halves) for i in half}
    for slot, status in zip(swarm.slots, statuses, strict=True):
        history = [h for h in status.get("history", []) if h["inner_step"] <= steps]
        run.outer_steps += len(history)
        run.blends += sum(1 for h in history if h["partner"])
        honest_blends = sum(1 for h in history if h["partner"] in honest_ids)
        run.turncoat_blends += sum(1 for h in history if h["partner"] and h["partner"] == run.turncoat.get("peer_id"))
        run.honest_blends += honest_blends
        run.node_honest.append((honest_blends, len(history)))
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
    if attack and placement.sybil6:  # its last keys, one per IPv6 address (_sybil_hosts)
        sybil6_ids = set(run.sybil.get("peer_ids", [])[-len(placement.sybil6) :])
        run.sybil6_keys = len(sybil6_ids)
        run.sybil6_blends = sum(
            1 for status in statuses for h in status.get("history", []) if h["partner"] in sybil6_ids
        )
    donors = reports.get("donors", {}).get("peer_ids", [])
    if swarm.slots[-1].lives > 1:
        run.restart = _second_life(swarm, swarm.slots[-1], statuses[-1], steps, donors, "resumed its checkpoint")
    if swarm.slots[0].lives > 1:
        run.joiner = _second_life(swarm, swarm.slots[0], statuses[0], steps, donors, "DOWNLOADED NOTHING")
    return run


def _first_lives_ids(swarm: LocalSwarm) -> set[str]:
    """The peer ids of lives that ended (the node killed for the joiner): honest partners too."""
    ids: set[str] = set()
    for slot in swarm.slots:
        for life in range(1, slot.lives):
            log = (swarm.base / f"node{slot.index}.life{life}.log").read_text(errors="replace")
            ids.update(line.split(" up: run ")[0].split()[-1] for line in log.splitlines() if " up: run " in line)
    return ids


def _second_life(
    swarm: LocalSwarm, slot: NodeSlot, status: dict[str, Any], steps: int, donors: list[str], otherwise: str
) -> str:
    """What a node's last life did: downloaded a state (from an honest peer or a fake donor) or ``otherwise``, and
    whether it trained to the end (its last inner step at ``steps``, no crash)."""
    log = (swarm.base / f"node{slot.index}.life{slot.lives}.log").read_text(errors="replace")
    if "joined a run in progress: state of outer step" in log:
        source = log.split("joined a run in progress: state of outer step")[1].split()[2]
        fake = any(peer_id.endswith(source) for peer_id in donors)
        start = f"downloaded a state from {'A FAKE DONOR' if fake else 'an honest peer'}"
    else:
        start = otherwise
    history = status.get("history", [])
    end = history[-1]["inner_step"] if history else 0
    finished = end == steps and not slot.crashes
    return f"{start} and {'trained to the end' if finished else f'STOPPED AT INNER STEP {end} of {steps}'}"


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
        if shape.on_network:
            net = stack.enter_context(
                shaped_network(
                    shape.nodes + 1,
                    rate_mbit=1000,
                    rtt_ms=0,
                    prefix="nlout",
                    subnet=PUBLIC_SUBNET,
                    subnet6=PUBLIC_SUBNET6,
                )
            )
            host = shape.nodes  # the attackers' host: its main address and thirteen more of its /24
            main, payloads, flood_a, flood_b, donor_a, donor_b, *sybil = net.address(host), *net.add_addresses(host, 13)
            placement = Placement(
                tuple(net.exec_prefix(host)),
                main,
                payloads,
                (flood_a, flood_b),
                main,
                (donor_a, donor_b),
                tuple(sybil),
                tuple(net.add_addresses6(host, 8)),
                tuple((net.address(i), net.address6(i)) for i in range(shape.nodes)),
            )
        quiet = _run(out / "quiet", "without outsider", shape, attack=False, network=net, cpu=cpu)
        attacked = _run(
            out / "attacked", "with outsider", shape, attack=True, network=net, placement=placement, cpu=cpu
        )
    return OutsiderBenchResult(quiet, attacked, cpu.describe)
