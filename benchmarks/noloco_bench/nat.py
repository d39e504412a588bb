"""`noloco-node bench nat`: the same swarm with and without NATs, in one run (nat_network.py).

Six members on shaped links: first all on the public segment (the reference), then two public and four behind two
home routers (port-restricted and symmetric NAT, two members to a router), reached through relays
(discovery/tunnels.py), or directly where a hole punch gets through (discovery/hole_punch.py: a public member's
calls to any of them; here no two NAT'd members can, being behind one router or a symmetric one). Each run is
measured for the same wall time once every member knows whether it can be dialed (and, behind a NAT, holds its
relays) and has blended at its last three outer steps: blend rate (outer steps with a partner), time per outer
step, bytes the relays carried, pairs of two NAT'd members and tunnels made direct. Needs root and nftables.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from noloco_bench.nat_network import Home, NatNetwork, nat_network
from noloco_node.launcher.local_swarm import LocalSwarm

HOMES = (Home("port_restricted", 2), Home("symmetric", 2))


def node_args(model: str, inner_steps: int) -> list[str]:
    return [
        *("--model", model, "--seq-len", "64", "--batch-size", "8", "--eval-batches", "2"),
        *("--steps", "100000", "--inner-steps", str(inner_steps), "--warmup-steps", "10", "--log-every", "0"),
        *("--wait-for-peers", "5", "--record-ttl", "10", "--torch-threads", "1"),
        # Reaching each other is measured here. CPU-bound nodes sharing two cores drift apart early, and the
        # adaptive norm bound then refuses a far partner (its own benchmark is `bench outsider`): a fixed, loose
        # bound keeps that out of the figures.
        *("--norm-bound", "2.0"),
        # For the same reason, a member the scheduler slows for a while falls a few outer steps behind, out of its
        # partners' reach (and steps alone until it catches up): a wider reach keeps that out of the figures too.
        *("--max-staleness", "8"),
    ]


@dataclass(frozen=True)
class MemberFigures:
    label: str  # "public" or the kind of NAT it is behind
    public_address: str
    outer_steps: int
    blended: int
    seconds_per_outer_step: float
    relayed_bytes: int
    tunnels_served: int
    tunnels_opened: int
    tunnels_punched: int  # of the tunnels it opened or served since its start, those made direct (hole_punch.py)
    nat_partners: int  # blends with another member behind a NAT (this member being behind one too)
    served: int  # of its last exchanges (status `exchanges`), those it was called for: behind a NAT, all relayed
    reachable: bool

    @property
    def blend_rate(self) -> float:
        return self.blended / max(1, self.outer_steps)


@dataclass(frozen=True)
class SwarmFigures:
    name: str
    members: tuple[MemberFigures, ...]
    exit_codes: tuple[int, ...]

    @property
    def relayed_bytes(self) -> int:
        return sum(m.relayed_bytes for m in self.members)

    @property
    def direct_tunnels(self) -> int:
        """Tunnels a hole punch made direct: each is counted by both its ends."""
        return sum(m.tunnels_punched for m in self.members) // 2

    @property
    def nat_pairs(self) -> int:
        return sum(m.nat_partners for m in self.members)

    def row(self) -> str:
        rates = [m.blend_rate for m in self.members]
        step = sum(m.seconds_per_outer_step for m in self.members) / len(self.members)
        return (
            f"| {self.name} | {min(rates):.2f} | {sum(rates) / len(rates):.2f} | {step:.2f} | "
            f"{self.relayed_bytes / 1e6:.1f} | {self.nat_pairs} | {self.direct_tunnels} |"
        )


def measure_swarm(
    net: NatNetwork, base: Path, args: Sequence[str], *, seconds: float, name: str, settle_seconds: float = 180.0
) -> SwarmFigures:
    """Run one node per member of ``net``; once each knows its reachability (and holds relays if it is behind a
    NAT), measure for ``seconds``."""
    behind = [m.behind is not None for m in net.members]
    swarm = LocalSwarm(base, len(net.members), args, network=net)
    try:

        def statuses() -> list[dict[str, Any]]:
            return [swarm.status(slot) or {} for slot in swarm.slots]

        def settled(status: dict[str, Any], nat: bool) -> bool:
            """It knows whether it can be dialed, holds relays if not, and trains in step with the swarm (a swarm
            launched together: the first outer steps of a member that started late are alone until it catches up)."""
            reached = status.get("reachable") is (not nat) and (not nat or len(status.get("relays", [])) >= 1)
            recent = status.get("history", [])[-3:]
            return reached and len(recent) == 3 and all(h["partner"] for h in recent)

        deadline = time.monotonic() + settle_seconds
        while not all(settled(s, nat) for s, nat in zip(statuses(), behind, strict=True)):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{name}: not settled: {[(s.get('reachable'), s.get('relays')) for s in statuses()]}"
                )
            time.sleep(1)
        start, initial = time.time(), statuses()
        time.sleep(seconds)
        final = statuses()
    finally:
        codes = swarm.stop()
    index = {s["peer_id"]: i for i, s in enumerate(final)}
    members = []
    for i, status in enumerate(final):
        steps = [h for h in status["history"] if h["time"] > start]
        blended = [h for h in steps if h["partner"]]
        times = [h["time"] for h in steps]
        members.append(
            MemberFigures(
                label=net.members[i].behind or "public",
                public_address=net.members[i].public_address,
                outer_steps=len(steps),
                blended=len(blended),
                seconds_per_outer_step=(times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan"),
                # what was carried, served and opened within the measured window
                relayed_bytes=int(status["relayed_bytes"]) - int(initial[i]["relayed_bytes"]),
                tunnels_served=int(status["tunnels_served"]) - int(initial[i]["tunnels_served"]),
                tunnels_opened=int(status["tunnels_opened"]) - int(initial[i]["tunnels_opened"]),
                # since the start: connections are kept, so most tunnels are made while the swarm settles
                tunnels_punched=int(status["tunnels_punched"]),
                nat_partners=sum(1 for h in blended if behind[i] and behind[index.get(h["partner"], 0)]),
                served=sum(1 for e in status["exchanges"] if e["role"] == "served" and e["outcome"] == "completed"),
                reachable=bool(status["reachable"]),
            )
        )
    return SwarmFigures(name, tuple(members), tuple(codes))


def run_nat_bench(
    *, seconds: float, model: str, inner_steps: int, rate_mbit: float, rtt_ms: float, out: Path
) -> list[SwarmFigures]:
    args = node_args(model, inner_steps)
    results = []
    for name, public, homes in (("no NAT (6 public)", 6, ()), ("NATs (2 public, 4 behind 2 routers)", 2, HOMES)):
        with nat_network(public, homes, rate_mbit=rate_mbit, rtt_ms=rtt_ms, prefix="nlbnat") as net:
            results.append(measure_swarm(net, out / name.split()[0].lower(), args, seconds=seconds, name=name))
    return results


def report(results: Sequence[SwarmFigures]) -> str:
    lines = [
        "| swarm | blend rate (worst member) | blend rate (mean) | s per outer step | MB relayed | NAT-NAT blends "
        "| tunnels made direct |",
        "|---|---|---|---|---|---|---|",
        *(r.row() for r in results),
        "",
        "per member (the NAT run):",
    ]
    for m in results[-1].members:
        lines.append(
            f"  {m.label:>15} {m.public_address:>11}: blended {m.blended}/{m.outer_steps}, relayed "
            f"{m.relayed_bytes} bytes for others, tunnels served {m.tunnels_served}, opened {m.tunnels_opened}, "
            f"direct by hole punch {m.tunnels_punched}; "
            f"called in {m.served} of its last exchanges"
        )
    return "\n".join(lines)
