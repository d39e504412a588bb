"""Who a node believes: the id it quarantines, pairs with and reports is the one the caller proved (a signature
with its own key, made for this server), never the manifest's word. Real node process, real gRPC, raw clients."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import grpc

from noloco_node.rpc.contracts import EXCHANGE_METHOD
from noloco_node.security.caller_proof import prove
from noloco_node.security.identity import NodeIdentity

from .attacker import exchange_status, frames_of, fresh_identity, node_weights, payload, sealed
from .swarm_harness import Bootstrap, NodeProcess

TRAIN = ["--model", "tiny", "--seq-len", "64", "--batch-size", "8", "--eval-batches", "2"]


def test_a_payload_under_another_peers_id_is_refused_and_that_peer_is_untouched(
    bootstrap: Bootstrap, tmp_path: Path
) -> None:
    node = NodeProcess("target", bootstrap, tmp_path, *TRAIN, "--steps", "100000", "--shard-index", "0")
    try:
        deadline = time.monotonic() + 90
        while not ((status := node.status()) and status["address"] and status["inner_step"] > 0):
            assert time.monotonic() < deadline and node.process.poll() is None, node.output()[-3000:]
            time.sleep(0.2)
        address, target, run = status["address"], status["peer_id"], status["run_fingerprint"]
        weights = node_weights(seq_len=64)
        honest, attacker = fresh_identity(), fresh_identity()

        def frames(peer_id: str) -> list[bytes]:
            return frames_of(payload(weights, run_fingerprint=run, peer_id=peer_id, outer_step=0))

        def send(peer_id: str, sender: NodeIdentity, proof: list[tuple[str, str]]) -> tuple[grpc.StatusCode, str]:
            # Sealed by the one who sends it (security/payload_seal.py), as any caller seals its payloads.
            return exchange_status(address, sealed(frames(peer_id), sender, target, proof), proof)

        # The attacker proves its own id and sends a payload in the honest peer's name: refused, before any blend.
        code, details = send(honest.peer_id, attacker, prove(attacker, EXCHANGE_METHOD, target))
        assert code == grpc.StatusCode.PERMISSION_DENIED and attacker.peer_id in details, details
        # Without a proof, with a proof made for another server, or with a proof used before: UNAUTHENTICATED.
        assert exchange_status(address, frames(honest.peer_id), None)[0] == grpc.StatusCode.UNAUTHENTICATED
        elsewhere = prove(honest, EXCHANGE_METHOD, "nl-some-other-server")
        assert exchange_status(address, frames(honest.peer_id), elsewhere)[0] == grpc.StatusCode.UNAUTHENTICATED
        captured = prove(honest, EXCHANGE_METHOD, target)
        first = send(honest.peer_id, honest, captured)[0]
        assert first not in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED), first
        assert send(honest.peer_id, honest, captured)[0] == grpc.StatusCode.UNAUTHENTICATED
        # The honest peer is not quarantined: with a fresh proof it is heard (served, or told busy: not refused).
        code, details = send(honest.peer_id, honest, prove(honest, EXCHANGE_METHOD, target))
        assert code not in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED), (code, details)
        # The one held to account is the sender: even in its own name it is now refused.
        code, details = send(attacker.peer_id, attacker, prove(attacker, EXCHANGE_METHOD, target))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "refused" in details, details

        with urllib.request.urlopen(f"{status['status_url']}/status", timeout=10) as answer:  # live, not status.json
            rejected = json.loads(answer.read())["rejected_payloads"]
        assert rejected.get("spoofed_peer_id") == 1
        assert rejected.get("identity_no_proof") == 1 and rejected.get("identity_replayed_proof") == 1
        assert rejected.get("identity_bad_proof") == 1
        assert node.process.poll() is None
    finally:
        node.stop()
