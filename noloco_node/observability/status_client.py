"""`noloco-node status` and `noloco-node peers`: an operator's view of one node and of the swarm.

``status`` reads a node's `GET /status` (or the status.json in its data directory), validates it against the
schema in status.py and prints a readable table. ``peers`` joins the DHT as a read-only client and lists the
live records of a run: who is there, at which step, at which address, and how fresh the record is.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from noloco_node.errors import NolocoError
from noloco_node.observability.status import NodeStatus
from noloco_node.observability.status_file import STATUS_FILE

if TYPE_CHECKING:
    from noloco_node.discovery.dht import PeerRecord
    from noloco_node.security.auth import SwarmSecret


class StatusClientError(NolocoError):
    """The status could not be read; the message says where and why."""


def fetch_status(url: str, *, timeout: float = 5.0) -> NodeStatus:
    """``url`` is a node's base URL (http://host:port) or its /status URL."""
    target = url.rstrip("/")
    if not target.endswith("/status"):
        target += "/status"
    try:
        with urllib.request.urlopen(target, timeout=timeout) as response:
            body = response.read()
    except (urllib.error.URLError, OSError) as error:
        raise StatusClientError(f"cannot read {target}: {getattr(error, 'reason', error)}") from None
    return parse_status(body, source=target)


def read_status_file(data_dir: Path) -> NodeStatus:
    path = data_dir / STATUS_FILE
    try:
        body = path.read_bytes()
    except OSError as error:
        raise StatusClientError(f"cannot read {path}: {error.strerror}") from None
    return parse_status(body, source=str(path))


def parse_status(body: bytes, *, source: str) -> NodeStatus:
    try:
        return NodeStatus.model_validate_json(body)
    except ValidationError as error:
        raise StatusClientError(f"{source} does not match the status schema: {error.errors()[0]['msg']}") from None


def status_schema() -> str:
    return json.dumps(NodeStatus.model_json_schema(), indent=2)


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def format_status(status: NodeStatus) -> str:
    rows = [
        ("node", f"{status.peer_id}  (v{status.version}, {status.mode} mode, model {status.model_size})"),
        ("run", f"{status.run_name}  fingerprint {status.run_fingerprint}"),
        ("health", str(status.health) + ("" if status.health.ok else "   [/healthz: 503]")),
        ("uptime", _age(status.uptime_seconds)),
        ("steps", f"inner {status.inner_step} / {status.total_steps}, outer {status.outer_step}"),
        ("learning rate", "-" if status.learning_rate is None else f"{status.learning_rate:.2e}"),
        ("train loss", f"{_num(status.train_loss)} (recent mean)"),
        ("val loss", f"{_num(status.val_loss)}  perplexity {_num(status.val_perplexity, 2)}"),
        ("tokens/s", _num(status.tokens_per_second, 0)),
        ("waiting on peers", f"{100 * status.comm_wait_fraction:.1f}% of trainer time"),
        ("checkpoint age", _age(status.checkpoint_age_seconds)),
        ("bytes", f"sent {status.bytes_sent / 1e6:.1f} MB, received {status.bytes_received / 1e6:.1f} MB"),
        ("exchanges", ", ".join(f"{k} {v}" for k, v in sorted(status.exchange_outcomes.items())) or "-"),
        ("refused payloads", ", ".join(f"{k} {v}" for k, v in sorted(status.rejected_payloads.items())) or "-"),
        ("receipts", ", ".join(f"{k} {v}" for k, v in sorted(status.receipts.items())) or "-"),
        ("gRPC address", status.address),
        ("status URL", status.status_url),
    ]
    width = max(len(key) for key, _ in rows)
    lines = [f"{key:<{width}}  {value}" for key, value in rows]
    lines.append("")
    lines.append(f"peers ({len(status.peers)}):")
    lines.append(f"  {'peer':<10} {'address':<22} {'outer':>5} {'inner':>6} {'val loss':>8}  {'health':<24} record age")
    for peer in status.peers:
        lines.append(
            f"  {peer.peer_id[-8:]:<10} {peer.address:<22} {peer.outer_step:>5} {peer.inner_step:>6} "
            f"{_num(peer.val_loss):>8}  {(peer.health or '-'):<24} {_age(peer.record_age_seconds)}"
        )
    lines.append("")
    lines.append(f"last exchanges ({len(status.exchanges)}):")
    for entry in status.exchanges[-10:]:
        lines.append(
            f"  {time.strftime('%H:%M:%S', time.localtime(entry.time))} {entry.role:<6} {entry.peer[-8:]:<10} "
            f"{entry.outcome:<16} {entry.seconds:7.2f} s  sent {entry.bytes_sent / 1e6:7.1f} MB  "
            f"received {entry.bytes_received / 1e6:7.1f} MB"
        )
    return "\n".join(lines)


def list_peers(
    bootstrap: list[str], run_fingerprint: str, *, wait: float = 3.0, secret: SwarmSecret | None = None
) -> list[PeerRecord]:
    """The live records of a run, read through a client-only DHT peer that publishes nothing; with a private run's
    secret, only records that its members wrote."""
    from noloco_node.discovery.dht import Discovery  # hivemind is slow to import: only this command needs it

    discovery = Discovery(run_fingerprint, initial_peers=bootstrap, client_mode=True, secret=secret)
    discovery.start()
    try:

        async def look() -> list[PeerRecord]:
            deadline = time.monotonic() + wait
            while True:  # a fresh DHT client may need a moment before its first lookup finds anything
                records = await discovery.live_peers()
                if records or time.monotonic() > deadline:
                    return records
                await asyncio.sleep(0.5)

        return asyncio.run(look())
    finally:
        discovery.shutdown()


def format_peers(records: list[PeerRecord], run_fingerprint: str, *, now: float | None = None) -> str:
    from hivemind.utils import get_dht_time

    now = get_dht_time() if now is None else now
    lines = [f"run {run_fingerprint}: {len(records)} live peer(s)"]
    lines.append(f"  {'peer id':<54} {'address':<22} {'outer':>5} {'inner':>6} {'ready':<5} record age")
    for record in sorted(records, key=lambda r: r.peer_id):
        lines.append(
            f"  {record.peer_id:<54} {record.address:<22} {record.outer_step:>5} {record.inner_step:>6} "
            f"{'yes' if record.ready else 'no':<5} {_age(max(0.0, now - record.updated))}"
        )
    return "\n".join(lines)
