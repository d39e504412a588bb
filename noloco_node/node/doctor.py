"""`noloco-node doctor`: what stops a first join, found before it fails, each with a one-line fix.

It takes the settings `join` takes and checks, in order:

- **this machine** (node/machine_checks.py, also printed as one block when `join` starts): the torch build
  against the device, host and device memory for the chosen model, disk for its checkpoints, the announced
  address, the gRPC port free;
- **the network** (doctor only, :func:`network_checks`, here): each bootstrap peer answers on its TCP port; the DHT
  starts through them; the run's live peers, and peers of the same run name that started from other settings
  (they refuse this node's: the differing setting is named); the clock against the peers' records; whether a
  peer sees this machine's calls come from the announced address (else it is behind a NAT and will be reached
  through relays, discovery/reachability.py); and whether that peer can open a connection back to its gRPC and DHT
  ports (rpc/info_serving.py: a firewall, a missing or misdirected port forward).

A failed check exits 1; a warning (a NAT, no peer yet) does not. ``--json`` prints the checks as a list.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import statistics
import time
import urllib.request
from collections.abc import Iterator, Sequence

import torch

from noloco_node.config.models import TrainConfig
from noloco_node.config.node_config import NodeConfig
from noloco_node.discovery.dht import Discovery, PeerRecord, RunStart
from noloco_node.discovery.reachability import WitnessView, announce_host, ask_witness, witnesses_for
from noloco_node.node.machine_checks import Check, identity, local_checks
from noloco_node.node.run_layout import RunLayout
from noloco_node.rpc.transport import PLAIN


def bootstrap_answers(entry: str, *, timeout: float = 5.0) -> Check:
    """A bootstrap multiaddr's TCP port accepts a connection (or its http:// address book answers)."""
    if entry.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(entry, timeout=timeout) as answer:
                answer.read(1 << 16)
        except (OSError, ValueError) as error:
            return Check("bootstrap", "fail", f"{entry}: {error}", "start the bootstrap peer or fix the address")
        return Check("bootstrap", "ok", f"{entry} answers")
    parts = entry.split("/")
    try:
        host, port = parts[2], int(parts[4])
    except (IndexError, ValueError):
        return Check("bootstrap", "fail", f"{entry} is not /ip4|ip6|dns/HOST/tcp/PORT/p2p/ID", "copy it as printed")
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as error:
        return Check(
            "bootstrap",
            "fail",
            f"{host}:{port} does not answer ({error.strerror or error})",
            "is the bootstrap peer running? `noloco-node bootstrap` prints the addresses to join with; a firewall "
            f"between must let TCP {port} through",
        )
    return Check("bootstrap", "ok", f"{host}:{port} answers")


def clock(records: Sequence[PeerRecord], now: float, *, record_ttl: float, tolerance: float) -> Check:
    """Peers refresh their records every record_ttl/3 s, stamped with their clock: against this machine's clock
    the freshest is between 0 and record_ttl/3 s old; far outside that, one of the clocks is off."""
    if not records:
        return Check("clock", "ok", "no peer record to compare with")
    ages = [now - r.updated for r in records]
    freshest = min(ages)
    typical = statistics.median(ages)
    if freshest < -tolerance or freshest > record_ttl / 3 + tolerance:
        off = -freshest if freshest < 0 else freshest - record_ttl / 3
        direction = "behind" if freshest < 0 else "ahead of"
        return Check(
            "clock",
            "fail",
            f"this clock is at least {off:.0f} s {direction} the peers' (their freshest record is {freshest:.0f} s "
            f"old, median {typical:.0f} s): caller proofs beyond {tolerance:.0f} s of skew are refused",
            "synchronise the clock (timedatectl set-ntp true, or chrony)",
        )
    return Check("clock", "ok", f"within {max(abs(freshest), 0):.1f} s of the peers' ({len(records)} records)")


async def network_checks(
    cfg: NodeConfig, layout: RunLayout, *, now: float | None = None, timeout: float = 5.0
) -> list[Check]:
    checks = [bootstrap_answers(entry, timeout=timeout) for entry in cfg.bootstrap]
    if not cfg.bootstrap:
        return [Check("bootstrap", "warn", "no --bootstrap: this node would start a swarm of its own")]
    if any(c.level == "fail" for c in checks):
        return checks
    discovery = Discovery(
        layout.run_fingerprint,
        initial_peers=cfg.bootstrap,
        host_maddrs=cfg.dht_host_maddrs,
        client_mode=True,
        run_name=cfg.run_name,
        start=layout.start,
    )
    try:
        await asyncio.to_thread(discovery.start)
    except Exception as error:  # hivemind's own errors: whatever stops the DHT stops a join
        return [*checks, Check("DHT", "fail", f"could not join through the bootstrap: {error}", "check --bootstrap")]
    try:
        checks.append(Check("DHT", "ok", "joined through the bootstrap"))
        peers = await discovery.live_peers()
        others = await discovery.other_starts()
        checks.append(_run_check(cfg, layout, peers, others))
        checks.append(
            clock(
                peers,
                time.time() if now is None else now,
                record_ttl=cfg.record_ttl,
                tolerance=cfg.security.max_clock_skew,
            )
        )
        checks.extend(await asyncio.to_thread(_from_outside, cfg, peers, timeout))
    finally:
        await asyncio.to_thread(discovery.shutdown)
    return checks


def _run_check(cfg: NodeConfig, layout: RunLayout, peers: list[PeerRecord], others: list[RunStart]) -> Check:
    if others and not peers:
        return Check(
            "run",
            "fail",
            others[0].refusal(cfg.run_name, layout.start),
            "take the swarm's settings (`noloco-node config show` on a member) or another --run-name",
        )
    detail = f"{len(peers)} live peers of run {cfg.run_name!r} (fingerprint {layout.run_fingerprint})"
    if others:
        detail += f"; {len(others)} more of this run name refuse this node's settings"
    if not peers:
        return Check("run", "warn", detail + ": this node would be the first", "")
    return Check("run", "ok", detail)


def _from_outside(cfg: NodeConfig, peers: list[PeerRecord], timeout: float) -> list[Check]:
    """Asked of one of up to three reachable peers (off this machine's /24 where there are some: a neighbour sees
    its private side) over plain gRPC (a private run's peers refuse it: a warning then): where this machine's calls
    come from, and whether the peer can open a connection back to its gRPC and DHT ports (rpc/info_serving.py). While
    it asks, this command listens on the gRPC port itself, so that a connection that reaches another machine (a
    port forward to the wrong one) is told apart from one that reaches this one."""
    host = announce_host(cfg.grpc_host, cfg.announce_host)
    grpc_public, dht_public = cfg.announce_port or cfg.grpc_port, _dht_port(cfg)
    ports = [p for p in (grpc_public, dht_public) if p]
    candidates = [(p.address, p.peer_id) for p in peers if p.reachable and p.address]
    candidates = witnesses_for(f"{host}:0", candidates) or candidates
    with _listening(cfg) as listener:
        for address, peer_id in candidates[:3]:
            try:
                view = ask_witness(address, peer_id, PLAIN, dial_back=ports, timeout=timeout)
            except Exception:  # that peer is gone or busy: the next
                continue
            if view.seen:
                break
        else:
            return [
                Check("reachable", "warn", "no reachable peer answered to say where this machine's calls come from")
            ]
        heard = _accepted(listener)
    behind_nat = view.seen != host
    if behind_nat:
        checks = [
            Check(
                "reachable",
                "warn",
                f"{address} sees this machine's calls come from {view.seen}, not {host}: behind a NAT, this node "
                "will be reached through relays (their bandwidth)",
                f"to be dialed directly, forward the gRPC port to this machine and pass --announce-host {view.seen}",
            )
        ]
    else:
        checks = [Check("reachable", "ok", f"{address} sees this machine as {view.seen}, the announced address")]
    if grpc_public:
        checks.append(
            _port_check("gRPC port from outside", address, view, grpc_public, behind_nat, cfg.grpc_port, heard)
        )
    else:
        checks.append(Check("gRPC port from outside", "ok", "not checked: --grpc-port 0 lets join pick a port"))
    if dht_public:
        checks.append(_port_check("DHT port from outside", address, view, dht_public, behind_nat, None, None))
    else:
        checks.append(Check("DHT port from outside", "ok", "not checked: the DHT listens on a port of its choosing"))
    return checks


def _port_check(
    name: str, witness: str, view: WitnessView, port: int, behind_nat: bool, bound: int | None, heard: bool | None
) -> Check:
    """One dial-back's answer. Behind a NAT a closed port is expected (a warning: relays reach the node); on an
    address that is this machine's own, it is what stops peers from dialing it (a failure)."""
    where = f"{view.seen}:{port}"
    why = view.dialed.get(port, "not tried")
    forward = f" to this machine's port {bound}" if bound is not None and bound != port else " to this machine"
    if why:
        return Check(
            name,
            "warn" if behind_nat else "fail",
            f"{witness} could not open a connection to {where} ({why})",
            f"open TCP {port} in the firewall (cloud: the security group), or forward it{forward}; "
            "until then peers reach this node only through relays",
        )
    if heard is False:
        return Check(
            name,
            "fail",
            f"{witness} opened a connection to {where}, but not to this machine: something else answers there",
            f"forward TCP {port}{forward}, not to another one",
        )
    return Check(name, "ok", f"{witness} opened a connection to {where}")


def _dht_port(cfg: NodeConfig) -> int:
    """The DHT's TCP port that peers dial (its announced multiaddr's, else the one it listens on); 0 if ephemeral."""
    for maddr in [*cfg.dht_announce_maddrs, *cfg.dht_host_maddrs]:
        parts = maddr.split("/")
        if "tcp" in parts and parts.index("tcp") + 1 < len(parts) and parts[parts.index("tcp") + 1].isdigit():
            return int(parts[parts.index("tcp") + 1])
    return 0


@contextlib.contextmanager
def _listening(cfg: NodeConfig) -> Iterator[socket.socket | None]:
    """A listener on the gRPC port that join will bind (the gRPC port check found it free), or None."""
    if not cfg.grpc_port:
        yield None
        return
    listener = socket.socket()
    try:
        listener.bind(("0.0.0.0" if cfg.grpc_host in ("", "0.0.0.0") else cfg.grpc_host, cfg.grpc_port))
        listener.listen(8)
    except OSError:  # held by another process: the gRPC port check says so
        listener.close()
        yield None
        return
    with listener:
        yield listener


def _accepted(listener: socket.socket | None) -> bool | None:
    """Whether a connection reached the listener (its handshake completes in the kernel, answered or not)."""
    if listener is None:
        return None
    listener.setblocking(False)
    try:
        listener.accept()[0].close()
    except BlockingIOError:
        return False
    return True


def run_doctor(
    cfg: NodeConfig, layout: RunLayout, train_cfg: TrainConfig, gpu_memory: int | None = None
) -> list[Check]:
    """This machine's checks (with the step plan for its GPU, or for a GPU of ``gpu_memory`` bytes), then the
    network's."""
    device = train_cfg.device
    on_gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    checks = [*local_checks(cfg, train_cfg, layout.source, on_gpu, gpu_memory), identity(cfg.data_dir)]
    return checks + asyncio.run(network_checks(cfg, layout))
