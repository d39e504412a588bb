"""A consensus model of a live swarm: the equal-weight average of K peers' slow weights.

NoLoCo's replicas stay apart by design (arXiv 2506.10911, eq. 3-5 blend pairs, never the whole swarm), so the model
a run ships is defined here as

    phi_consensus = (1/K) * sum_k phi_k

over K live peers of the run, fetched over GetState (the joiners' download: every chunk checksummed, names,
shapes and dtypes checked against the run's layout, non-finite values refused) and weighted equally. The peers
with the highest outer steps are chosen; one that fails is replaced by the next. The spread is reported two ways:
each member's relative distance ||phi_k - phi_consensus|| / ||phi_consensus||, and the RMS standard deviation of
the weights across members (algorithm.replica_spread, the figure the paper plots).

The download is the whole outer snapshot (phi, Delta and Adam's two moments: four model-sized tensors); only phi
is kept, one copy per member, so memory is about K + 1 models.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from noloco_node import algorithm
from noloco_node.config.node_config import NodeConfig
from noloco_node.discovery.dht import Discovery, PeerRecord, RunStart
from noloco_node.errors import NolocoError
from noloco_node.model.source import ModelSource
from noloco_node.node.bootstrap import expand_bootstrap
from noloco_node.node.security import NodeSecurity
from noloco_node.rpc.client import ExchangeError
from noloco_node.rpc.state_download import StateDownload
from noloco_node.security.payload_guard import relative_distance
from noloco_node.training.checkpoints import state_layout


class ConsensusError(NolocoError):
    """Not enough live peers could serve their state."""


@dataclass
class Member:
    peer_id: str
    address: str
    outer_step: int
    inner_step: int
    distance: float = 0.0  # relative distance of its phi to the consensus
    val_loss: float | None = None


@dataclass
class Consensus:
    names: list[str]
    tensors: list[torch.Tensor]
    members: list[Member]
    member_weights: list[list[torch.Tensor]]
    spread: float = 0.0  # RMS std of the weights across members
    val_loss: float | None = None
    failures: list[str] = field(default_factory=list)

    def report(self) -> str:
        lines = [f"consensus of {len(self.members)} peers (equal weights), weight spread (RMS std) {self.spread:.3e}"]
        lines.append(f"  {'peer':<14} {'address':<22} {'outer':>5} {'inner':>6} {'dist to mean':>12} {'val loss':>9}")
        for m in self.members:
            loss = f"{m.val_loss:9.4f}" if m.val_loss is not None else f"{'-':>9}"
            lines.append(
                f"  {m.peer_id[-12:]:<14} {m.address:<22} {m.outer_step:>5} {m.inner_step:>6} "
                f"{m.distance:>12.4f} {loss}"
            )
        losses = [m.val_loss for m in self.members if m.val_loss is not None]
        if self.val_loss is not None and losses:
            mean = statistics.fmean(losses)
            verdict = "lower than or equal to" if self.val_loss <= mean else "HIGHER than"
            lines.append(
                f"  consensus val loss {self.val_loss:.4f}: {verdict} the members' mean {mean:.4f} "
                f"(best member {min(losses):.4f}, worst {max(losses):.4f})"
            )
        for failure in self.failures:
            lines.append(f"  skipped: {failure}")
        return "\n".join(lines)

    def provenance(self) -> dict[str, Any]:
        losses = [m.val_loss for m in self.members if m.val_loss is not None]
        return {
            "source": f"consensus of {len(self.members)} live peers",
            "weights": "mean of the members' phi (slow weights)",
            "members": [vars(m) for m in self.members],
            "spread_rms_std": self.spread,
            "val_loss": self.val_loss,
            "members_mean_val_loss": statistics.fmean(losses) if losses else None,
        }


def _candidates(discovery: Discovery, peers: int, wait: float) -> tuple[list[PeerRecord], list[RunStart]]:
    """Live, reachable peers with a snapshot (past their first outer step), highest outer step first; waits up to
    ``wait`` s for at least ``peers`` of them. With fewer: the nodes of this run name that train under another
    fingerprint, so that the error can say which setting differs."""

    async def look() -> tuple[list[PeerRecord], list[RunStart]]:
        deadline = time.monotonic() + wait
        while True:
            records = [p for p in await discovery.live_peers() if p.outer_step > 0 and p.address and p.reachable]
            if len(records) >= peers:
                return sorted(records, key=lambda p: (-p.outer_step, p.peer_id)), []
            if time.monotonic() > deadline:
                return sorted(records, key=lambda p: (-p.outer_step, p.peer_id)), await discovery.other_starts()
            await asyncio.sleep(1.0)

    return asyncio.run(look())


def fetch_consensus(
    node_cfg: NodeConfig,
    source: ModelSource,
    run_fingerprint: str,
    *,
    start: dict[str, str],
    peers: int,
    wait: float = 30.0,
    progress: Callable[[str], None] = print,
) -> Consensus:
    """Download K live peers' slow weights and average them (see the module docstring)."""
    if peers < 1:
        raise ConsensusError(f"--peers must be at least 1, not {peers}")
    bootstrap = expand_bootstrap(node_cfg.bootstrap, wait=node_cfg.bootstrap_wait)
    if not bootstrap:
        raise ConsensusError("give --bootstrap: the DHT address of the run (multiaddrs or http://HOST:PORT/maddrs)")
    layout = state_layout(source)
    names = [name.removeprefix("phi/") for name, _ in layout if name.startswith("phi/")]
    state_bytes = 4 * sum(torch.Size(shape).numel() for _, shape in layout)
    timeout = max(node_cfg.exchange_timeout, state_bytes / node_cfg.min_link_rate + 10.0)
    with tempfile.TemporaryDirectory(prefix="noloco-export-") as scratch:
        security = NodeSecurity(node_cfg.security, Path(scratch))  # a throwaway identity; the run's secret/TLS
        discovery = Discovery(
            run_fingerprint,
            initial_peers=bootstrap,
            client_mode=True,
            secret=security.secret,
            run_name=node_cfg.run_name,
            start=start,
        )
        discovery.start()
        try:
            candidates, others = _candidates(discovery, peers, wait)
        finally:
            discovery.shutdown()
        if len(candidates) < peers:
            differing = {other.run_fingerprint: other.refusal(node_cfg.run_name, start) for other in others}
            raise ConsensusError(
                f"run {run_fingerprint}: {len(candidates)} live peer(s) with a snapshot after {wait:.0f} s, "
                f"fewer than --peers {peers}"
                + "".join(f"\n{why}: pass the run's settings" for why in differing.values())
            )
        members: list[Member] = []
        weights: list[list[torch.Tensor]] = []
        failures: list[str] = []
        for record in candidates:
            if len(members) == peers:
                break
            download = StateDownload(layout, run_fingerprint=run_fingerprint, peer_id=security.peer_id)
            progress(
                f"downloading the state of {record.peer_id[-12:]} at {record.address} (outer step {record.outer_step})"
            )
            try:
                tensors, counters = download.fetch(
                    record.address, timeout=timeout, transport=security.transport, donor_peer_id=record.peer_id
                )
            except ExchangeError as error:
                failures.append(f"{record.peer_id[-12:]}: {error}")
                continue
            weights.append([tensors[f"phi/{name}"].float() for name in names])
            members.append(
                Member(record.peer_id, record.address, int(counters["outer_step"]), int(counters["inner_step"]))
            )
    if len(members) < peers:
        raise ConsensusError(f"only {len(members)} of {peers} peers served their state: " + "; ".join(failures))
    mean = algorithm.mean_weights(weights)
    for member, member_weights in zip(members, weights, strict=True):
        member.distance = relative_distance(member_weights, mean)
    return Consensus(names, mean, members, weights, algorithm.replica_spread(weights), failures=failures)
