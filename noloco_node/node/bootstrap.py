"""The bootstrap peer and how nodes find it: a DHT-only peer that trains nothing and introduces peers.

``noloco-node bootstrap`` runs :func:`run_bootstrap_peer`; with ``--http-port`` it also serves its multiaddrs at
``/maddrs`` (through observability/http_server.py, the project's one HTTP server), so that containers can join
with ``--bootstrap http://HOST:PORT/maddrs`` without knowing its peer id in advance (:func:`expand_bootstrap`).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from noloco_node.discovery.dht import BoundedRecords, RememberedSignatures, TiedDHT
from noloco_node.observability.http_server import StatusServer
from noloco_node.observability.status import Health
from noloco_node.security.identity import NodeIdentity

log = logging.getLogger(__name__)


def run_bootstrap_peer(
    host_maddrs: Sequence[str],
    announce_maddrs: Sequence[str] | None,
    *,
    initial_peers: Sequence[str] = (),
    http_bind: tuple[str, int] | None = None,
) -> list[str]:
    """A DHT-only peer that others join with ``--bootstrap``; prints its multiaddrs and serves until SIGINT/SIGTERM.

    With ``http_bind`` it also serves its multiaddrs over HTTP. Returns the multiaddrs it served on.
    """
    kwargs: dict[str, object] = {
        "host_maddrs": list(host_maddrs),
        "initial_peers": list(initial_peers) or None,
        # It stores other peers' records too: it must refuse writes that their owners did not sign.
        "record_validators": [RememberedSignatures(NodeIdentity.ephemeral().private_key), BoundedRecords()],
    }
    if announce_maddrs:
        kwargs["announce_maddrs"] = list(announce_maddrs)
    dht = TiedDHT(start=True, **kwargs)  # it forks: before the event loop starts any thread
    try:
        maddrs = [str(m) for m in dht.get_visible_maddrs()]
        print("bootstrap peer is up; join it with:", flush=True)
        for maddr in maddrs:
            print(f"  --bootstrap {maddr}", flush=True)
        asyncio.run(_serve(dht, http_bind))
        return maddrs
    finally:
        dht.shutdown()


async def _serve(dht: TiedDHT, http_bind: tuple[str, int] | None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    if http_bind is None:
        await stop.wait()
        return

    def book_page() -> tuple[str, bytes]:
        return "text/plain; charset=utf-8", ("\n".join(str(m) for m in dht.get_visible_maddrs()) + "\n").encode()

    book = StatusServer({"/maddrs": book_page}, healthz=lambda: Health(state="training", reason="", ok=True))
    port = await book.start(*http_bind)
    print(f"  --bootstrap http://HOST:{port}/maddrs", flush=True)
    try:
        await stop.wait()
    finally:
        await book.close()


def expand_bootstrap(entries: Sequence[str], *, wait: float = 120.0) -> list[str]:
    """The multiaddrs of ``--bootstrap`` entries: multiaddrs as given, and ``http(s)://`` entries fetched from a
    bootstrap peer's address book (retried until ``wait`` s have passed: in a compose file or a Kubernetes pod the
    bootstrap peer may still be starting)."""
    expanded: list[str] = []
    for entry in entries:
        if not entry.startswith(("http://", "https://")):
            expanded.append(entry)
            continue
        deadline = time.monotonic() + wait
        while True:
            try:
                with urllib.request.urlopen(entry, timeout=5) as answer:
                    found = [line.strip() for line in answer.read().decode().splitlines() if line.startswith("/")]
                if found:
                    expanded += found
                    break
                problem = "no multiaddrs in the answer"
            except (OSError, ValueError) as error:
                problem = str(error)
            if time.monotonic() >= deadline:
                raise OSError(f"bootstrap address book {entry} did not answer within {wait:.0f}s: {problem}")
            log.info("waiting for the bootstrap address book at %s (%s)", entry, problem)
            time.sleep(2.0)
    return expanded


def start_bootstrap_process(
    log_path: Path, *, timeout: float = 60.0, host: str = "127.0.0.1", exec_prefix: Sequence[str] = ()
) -> tuple[subprocess.Popen[str], list[str]]:
    """Start `noloco-node bootstrap` on ``host`` as a child process (behind ``exec_prefix``, e.g. ``ip netns exec
    NS``); returns it and the multiaddrs it printed."""
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [*exec_prefix, sys.executable, "-m", "noloco_node", "bootstrap", "--host-maddrs", f"/ip4/{host}/tcp/0"],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
    maddrs: list[str] = []
    deadline = time.monotonic() + timeout
    assert process.stdout is not None
    while time.monotonic() < deadline and not maddrs:
        line = process.stdout.readline()
        if not line:
            break
        if "--bootstrap" in line:
            maddrs.append(line.split("--bootstrap", 1)[1].strip())
    if not maddrs:
        process.kill()
        raise RuntimeError(f"the bootstrap peer did not start; see {log_path}")
    return process, maddrs
