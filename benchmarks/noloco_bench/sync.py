"""`noloco-node bench sync`: one NoLoCo pairwise exchange round against a ring all-reduce, on shaped links.

N hosts (N = 4, 8, 16, 32 by default), each a process in its own network namespace with a link shaped to a
bandwidth B and a round-trip time RTT (shaped_network.py: tc tbf for bandwidth, a user-space delaying router for
latency), each holding one tensor of S bytes. Measured in the same run (sync_worker.py):

- a pairwise round: every host exchanges its tensor with one random partner (both directions at once), over the
  node's gRPC exchange; the first round of a pairing on new connections (cold), then on the pooled ones (warm);
- a ring all-reduce of the same tensor with torch.distributed over gloo, the primitive DiLoCo implementations use;
- with ``hivemind=True``, a round of hivemind's DecentralizedAverager (butterfly all-reduce over libp2p) in a group
  of all N hosts, timed from its trigger after matchmaking (reported apart).

Printed next to them:

- the physical limit of the pairwise round: S / B + RTT (a host's upload and download each carry S once);
- the latency-bandwidth model of both: pairwise S/B + RTT; ring 2(N-1) (S/(N B) + RTT/2), since each of its
  2(N-1) steps moves S/N and waits for the previous step's data to arrive;
- the paper's model ratio (arXiv 2506.10911): a tree all-reduce costs about 2 t_c log2 N, a pairwise exchange 2 t_c.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from noloco_bench.shaped_network import ShapedNetwork, shaped_network


@dataclass
class SyncRow:
    hosts: int
    size_mb: float
    pairwise_cold: float
    pairwise_warm: float
    ring: float
    rate_mbit: float
    rtt_ms: float
    hivemind: float | None = None  # the all-reduce alone; None: not run, or matchmaking failed
    hivemind_matchmaking: float | None = None
    hivemind_failed_hosts: int = 0

    @property
    def bytes(self) -> float:
        return self.size_mb * 2**20

    @property
    def bandwidth(self) -> float:
        return self.rate_mbit * 1e6 / 8

    @property
    def limit(self) -> float:
        return self.bytes / self.bandwidth + self.rtt_ms / 1000

    @property
    def ring_model(self) -> float:
        n = self.hosts
        return 2 * (n - 1) * (self.bytes / (n * self.bandwidth) + self.rtt_ms / 2000)

    @property
    def measured_ratio(self) -> float:
        return self.ring / self.pairwise_warm

    @property
    def model_ratio(self) -> float:
        return self.ring_model / self.limit


@dataclass
class SyncResult:
    rate_mbit: float
    rtt_ms: float
    jitter_ms: float
    rows: list[SyncRow] = field(default_factory=list)

    def report(self) -> str:
        lines = [
            f"links: {self.rate_mbit:g} Mbit/s each way per host, RTT {self.rtt_ms:g} ms"
            + (f" +- {self.jitter_ms:g} ms jitter" if self.jitter_ms else ""),
            "| N | tensor | pairwise cold s | pairwise warm s | limit s | warm / limit | ring all-reduce s | "
            "ring model s | ring / pairwise | model ratio | paper log2 N | hivemind all-reduce s (matchmaking s) | "
            "hivemind / pairwise |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in self.rows:
            hivemind, versus = "not run", "-"
            if r.hivemind_failed_hosts:
                hivemind = f"failed on {r.hivemind_failed_hosts}/{r.hosts} hosts"
            elif r.hivemind is not None:
                hivemind = f"{r.hivemind:.3f} ({r.hivemind_matchmaking:.1f})"
                versus = f"{r.hivemind / r.pairwise_warm:.2f}x"
            lines.append(
                f"| {r.hosts} | {r.size_mb:g} MB | {r.pairwise_cold:.3f} | {r.pairwise_warm:.3f} | {r.limit:.3f} | "
                f"{r.pairwise_warm / r.limit:.2f}x | {r.ring:.3f} | {r.ring_model:.3f} | {r.measured_ratio:.2f}x | "
                f"{r.model_ratio:.2f}x | {math.log2(r.hosts):.2f}x | {hivemind} | {versus} |"
            )
        off = [r for r in self.rows if abs(r.measured_ratio / r.model_ratio - 1) > 0.3]
        if off:
            lines.append(
                "measured ring/pairwise differs from the model by more than 30% at: "
                + ", ".join(f"N={r.hosts} {r.size_mb:g} MB ({r.measured_ratio / r.model_ratio - 1:+.0%})" for r in off)
            )
        return "\n".join(lines)


def measure_rounds(
    net: ShapedNetwork,
    sizes_mb: list[float],
    *,
    warm_rounds: int = 2,
    ring_rounds: int = 2,
    hivemind: bool = False,
    progress: bool = True,
) -> list[SyncRow]:
    """One row per tensor size: a pairwise round (cold, then warm) and a ring all-reduce among all of ``net``'s
    hosts (sync_worker.py, one process per host)."""
    count = net.hosts
    rows: list[SyncRow] = []
    with tempfile.TemporaryDirectory(prefix="noloco-sync-") as tmp:
        out = Path(tmp) / "rank0.json"
        worker_args = [
            "--world", str(count), "--addresses", ",".join(net.address(i) for i in range(count)),
            "--sizes-mb", ",".join(f"{s:g}" for s in sizes_mb), "--warm-rounds", str(warm_rounds),
            "--ring-rounds", str(ring_rounds), "--out", str(out), "--rendezvous", tmp,
            *(["--hivemind"] if hivemind else []),
        ]  # fmt: skip
        logs = [(Path(tmp) / f"rank{i}.log").open("w") for i in range(count)]
        workers = [
            subprocess.Popen(
                [*net.exec_prefix(i), sys.executable, "-m", "noloco_bench.sync_worker", "--rank", str(i),
                 "--iface", net.device(i), *worker_args],
                stdout=logs[i],
                stderr=subprocess.STDOUT,
            )
            for i in range(count)
        ]  # fmt: skip
        codes = [w.wait(timeout=3600) for w in workers]
        for log in logs:
            log.close()
        failures = [line for i in range(count) for line in (Path(tmp) / f"rank{i}.log").read_text().splitlines()
                    if "round failed" in line]  # fmt: skip
        if failures and progress:
            print(f"N={count}: " + "\n".join(sorted(set(failures))[:5]), file=sys.stderr, flush=True)
        if any(codes) or not out.exists():
            failed = next((i for i, c in enumerate(codes) if c), 0)
            tail = (Path(tmp) / f"rank{failed}.log").read_text()[-3000:]
            raise RuntimeError(f"bench sync: host {failed} of {count} exited {codes[failed]}:\n{tail}")
        for entry in json.loads(out.read_text()):
            cold = entry["pairwise"][0]["seconds"]
            warm = min(p["seconds"] for p in entry["pairwise"][1:]) if len(entry["pairwise"]) > 1 else cold
            row = SyncRow(count, entry["size_mb"], cold, warm, min(entry["ring"]), net.rate_mbit, net.rtt_ms)
            if entry.get("hivemind"):
                row.hivemind = entry["hivemind"]["seconds"]
                row.hivemind_matchmaking = entry["hivemind"]["matchmaking_seconds"]
                row.hivemind_failed_hosts = entry["hivemind"].get("failed_hosts", 0)
            rows.append(row)
    return rows


def run_sync_bench(
    hosts: list[int],
    sizes_mb: list[float],
    *,
    rate_mbit: float = 100.0,
    rtt_ms: float = 50.0,
    jitter_ms: float = 0.0,
    warm_rounds: int = 2,
    ring_rounds: int = 2,
    hivemind: bool = True,
    progress: bool = True,
) -> SyncResult:
    result = SyncResult(rate_mbit, rtt_ms, jitter_ms)
    for count in hosts:
        with shaped_network(count, rate_mbit=rate_mbit, rtt_ms=rtt_ms, jitter_ms=jitter_ms) as net:
            started = time.monotonic()
            result.rows += measure_rounds(
                net, sizes_mb, warm_rounds=warm_rounds, ring_rounds=ring_rounds, hivemind=hivemind, progress=progress
            )
            if progress:
                print(f"N={count}: done in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return result
