"""A broken path healed (issue 28, "honest members that were apart find each other again"): two real node processes,
the real DHT and gRPC, each reached through a proxy (its announced port) that the test cuts both ways for a while,
as a partition or a dead home router does. During the cut each node's calls to the other fail, and it avoids the
other for --avoid-seconds, doubled at every failure (pairing/peer_policy.py); 600 s here, so that only the lift
can bring them together within the test. Once the path is whole, a node that avoids the other sees it answer Info
again after a silence (its watch of peers), and calls it again at once (PeerPolicy.answered_again)."""

from __future__ import annotations

import time
from pathlib import Path

from .swarm_harness import Bootstrap, NodeProcess, stop_all
from .throttling_proxy import ThrottlingProxy, free_port

ARGS = [
    *("--model", "tiny", "--seq-len", "64", "--batch-size", "8", "--eval-batches", "2"),
    *("--steps", "100000", "--inner-steps", "20", "--log-every", "0", "--wait-for-peers", "1"),
    *("--avoid-seconds", "600", "--pair-timeout", "3"),
]


def test_two_nodes_cut_apart_call_each_other_again_as_soon_as_the_path_is_whole(
    bootstrap: Bootstrap, tmp_path: Path
) -> None:
    grpc_ports = [free_port(), free_port()]
    proxies = [ThrottlingProxy(port, bytes_per_second=1 << 30) for port in grpc_ports]
    nodes = [
        NodeProcess(
            name,
            bootstrap,
            tmp_path,
            *ARGS,
            *("--shard-index", str(i), "--grpc-port", str(grpc_ports[i]), "--announce-port", str(proxies[i].port)),
        )
        for i, name in enumerate(("a", "b"))
    ]
    try:

        def histories() -> list[list[dict]]:
            return [(node.status() or {}).get("history", []) for node in nodes]

        def blended_since(since: float) -> list[bool]:
            return [any(h["partner"] and h["time"] > since for h in history) for history in histories()]

        deadline = time.monotonic() + 180
        while not all(blended_since(0.0)):
            assert time.monotonic() < deadline, "the two never blended"
            time.sleep(0.5)

        for proxy in proxies:
            proxy.interrupt()
        cut = time.time()
        # Each trains alone for a while: its calls to the other failed (it is avoided for 600 s or more now), and
        # so did its watch's Info calls (the other is silent).
        while not all(sum(1 for h in history if h["time"] > cut and not h["partner"]) >= 5 for history in histories()):
            assert time.monotonic() < deadline + 120, "the nodes did not step alone while cut apart"
            time.sleep(0.5)
        # An entry's time is stamped after its blend's loss check: the first entry after the cut may be an exchange
        # that was whole before it. Every exchange after that one was tried across the cut, and none blended.
        for history in histories():
            after_cut = [h for h in history if h["time"] > cut]
            assert not any(h["partner"] for h in after_cut[1:]), "a node blended while the path was cut"

        for proxy in proxies:
            proxy.restore()
        healed = time.time()
        deadline = time.monotonic() + 120
        while not all(blended_since(healed)):
            assert time.monotonic() < deadline, f"not blended again after the heal: {blended_since(healed)}"
            time.sleep(0.5)
        took = [
            round(min(h["time"] for h in history if h["partner"] and h["time"] > healed) - healed, 1)
            for history in histories()
        ]
        print(f"seconds from the heal to each node's first blend: {took} (their avoidance had 600 s or more to run)")
        # At least one side was lifted: it called the other, which blended as the served side (a node that had not
        # called during the cut, and so avoided nobody, needs no lift).
        assert any("answers again after a silence: called again at once" in node.output() for node in nodes)
    finally:
        stop_all(nodes)
        for proxy in proxies:
            proxy.close()
