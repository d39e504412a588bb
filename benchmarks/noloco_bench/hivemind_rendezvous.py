"""One hivemind DHT per benchmark host, joined through a shared folder: the start of every hivemind baseline.

`bench sync` (sync_worker.py) and `bench race`'s hivemind-H (diloco_worker.py) run hivemind's DecentralizedAverager
on N hosts. Each host's DHT binds that host's address (on a shaped network, its shaped link, so hivemind's traffic
crosses the links it is measured on); rank 0 writes its addresses to ``dht0`` in the folder, and the others join
from there. Call it before gloo, gRPC or torch threads exist: the DHT forks a helper process.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


def rendezvous_dht(rank: int, host: str, rendezvous: Path, wait_seconds: float = 300.0) -> Any:
    """This host's running ``hivemind.DHT``, bound to ``host`` and joined to rank 0's."""
    import hivemind

    first = rendezvous / "dht0"
    maddrs = [f"/ip4/{host}/tcp/0"]
    if rank == 0:
        dht = hivemind.DHT(start=True, host_maddrs=maddrs)
        staging = rendezvous / "dht0.tmp"
        staging.write_text("\n".join(str(m) for m in dht.get_visible_maddrs()))
        staging.rename(first)  # atomic: a joiner never reads half the addresses
        return dht
    deadline = time.monotonic() + wait_seconds
    while not first.exists():
        if time.monotonic() > deadline:
            raise TimeoutError("rank 0's DHT addresses never appeared")
        time.sleep(0.2)
    return hivemind.DHT(start=True, host_maddrs=maddrs, initial_peers=first.read_text().split())
