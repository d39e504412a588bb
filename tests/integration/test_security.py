"""A private run and TLS with real node processes, a real DHT and real gRPC on loopback.

Members (holding the swarm secret) pair and train; a caller without the secret, with a wrong one, with a replayed
or a stale signed request is refused with UNAUTHENTICATED and leaves no trace in the node's exchanges; a member
never sends its model to a server that cannot prove membership. With TLS, TLS peers exchange and a plaintext peer
can neither call them nor be called.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from noloco_node.rpc.client import ExchangeError, exchange_with, fetch_info
from noloco_node.rpc.contracts import EXCHANGE_METHOD, INFO_METHOD, AdmitsEverything
from noloco_node.rpc.metrics import ExchangeMetrics
from noloco_node.rpc.service import start_server
from noloco_node.rpc.state_download import StateDownload
from noloco_node.rpc.transport import CHANNEL_OPTIONS, Transport
from noloco_node.security.auth import CallAuthenticator, SwarmSecret
from noloco_node.security.caller_proof import prove
from noloco_node.security.tls import TlsFiles, write_ca, write_node_cert
from noloco_node.wire.frames import iter_frames, layout_of
from noloco_node.wire.receive_buffers import ReceiveBuffers

from .attacker import exchange_status, fresh_identity, node_weights, now_ms, payload, raw_info, signed_metadata
from .swarm_harness import Bootstrap, NodeProcess, stop_all

TRAIN = ["--model", "tiny", "--seq-len", "64", "--batch-size", "8", "--eval-batches", "4"]


def _secret_file(path: Path, value: str) -> Path:
    path.write_text(value + "\n")
    path.chmod(0o600)
    return path


def _wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


class _Stranger(AdmitsEverything):
    """A server at some address that does not hold the secret (an impostor, or a misconfigured peer)."""

    run_fingerprint = "unknown"
    peer_id = "stranger"

    def __init__(self) -> None:
        self.receive_buffers = ReceiveBuffers(max_idle_bytes=0)
        self.sessions = 0

    def expected_layout(self):
        return []

    wire_dtype = "fp32"  # what this double and its callers send

    def max_payload_bytes(self) -> int:
        return 10**9

    def open_session(self, partner_id: str, partner_outer_step: int, kind: str = "weights"):
        self.sessions += 1
        return None

    def info(self):
        raise AssertionError("never called")

    def state_snapshot(self):
        return None


def test_a_private_run_pairs_its_members_and_refuses_everyone_else(bootstrap: Bootstrap, tmp_path: Path) -> None:
    value = secrets.token_urlsafe(32)
    secret_path = _secret_file(tmp_path / "swarm.secret", value)
    common = [*TRAIN, "--steps", "240", "--inner-steps", "20", "--pair-timeout", "5", "--secret-file", str(secret_path)]
    members = [NodeProcess(f"member{i}", bootstrap, tmp_path, *common, "--shard-index", str(i)) for i in range(2)]
    stranger_server = None
    try:
        status = _wait_for(
            lambda: (s := members[0].status()) and s["address"] and s["inner_step"] > 0 and s, 120, "member0"
        )
        address, fingerprint = status["address"], status["run_fingerprint"]
        right = SwarmSecret(value.encode(), "test")
        wrong = SwarmSecret(secrets.token_bytes(32), "test")
        outgoing = payload(node_weights(), run_fingerprint=fingerprint, peer_id="intruder", outer_step=1)
        expected = layout_of(node_weights())

        def exchange(transport: Transport) -> ExchangeError:
            with pytest.raises(ExchangeError) as refused:
                exchange_with(
                    address,
                    outgoing,
                    expected,
                    run_fingerprint=fingerprint,
                    max_payload_bytes=10**8,
                    timeout=10,
                    transport=transport,
                )
            return refused.value

        # No secret, a wrong secret: every method refused before its handler runs.
        for transport in (Transport(), Transport(authenticator=CallAuthenticator(wrong, "intruder"))):
            assert exchange(transport).code == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises((grpc.RpcError, ExchangeError)) as info_refused:
                fetch_info(address, timeout=10, transport=transport)
            code = (
                info_refused.value.code() if isinstance(info_refused.value, grpc.RpcError) else info_refused.value.code
            )
            assert code == grpc.StatusCode.UNAUTHENTICATED
            download = StateDownload(
                [(n, tuple(t.shape)) for n, t in node_weights()], run_fingerprint=fingerprint, peer_id="intruder"
            )
            with pytest.raises(ExchangeError) as download_refused:
                download.fetch(address, timeout=10, transport=transport)
            assert download_refused.value.code == grpc.StatusCode.UNAUTHENTICATED and not download.done

        # A member's signed call goes through once; the same metadata again is a replay; an old one is stale.
        target = status["peer_id"]
        nonce = secrets.token_hex(16)
        signed = signed_metadata(right, INFO_METHOD, peer="intruder", target=target, sent_at_ms=now_ms(), nonce=nonce)
        # Captured on the path (no TLS) before it reached member0, the proof is replayed to the other member first:
        # it was made for member0 alone, so member1 refuses it, and member0 still takes the original once.
        other_member = _wait_for(lambda: (s := members[1].status()) and s["address"] and s, 120, "member1")
        assert raw_info(other_member["address"], signed) == grpc.StatusCode.UNAUTHENTICATED
        assert raw_info(address, signed) == grpc.StatusCode.OK
        assert raw_info(address, signed) == grpc.StatusCode.UNAUTHENTICATED
        stale = signed_metadata(
            right,
            INFO_METHOD,
            peer="intruder",
            target=target,
            sent_at_ms=now_ms() - 600_000,
            nonce=secrets.token_hex(16),
        )
        assert raw_info(address, stale) == grpc.StatusCode.UNAUTHENTICATED
        # A MAC made for another method does not open this one.
        other = signed_metadata(
            right,
            "/noloco.v1.Peer/GetState",
            peer="intruder",
            target=target,
            sent_at_ms=now_ms(),
            nonce=secrets.token_hex(16),
        )
        assert raw_info(address, other) == grpc.StatusCode.UNAUTHENTICATED

        # A member does not send its model to a server that cannot prove membership.
        stranger = _Stranger()
        stranger_metrics = ExchangeMetrics()
        stranger_server, port = start_server(stranger, stranger_metrics, bind="127.0.0.1:0")
        member_transport = Transport(authenticator=CallAuthenticator(right, "member-test"))
        with pytest.raises(ExchangeError) as impostor:
            exchange_with(
                f"127.0.0.1:{port}",
                outgoing,
                expected,
                run_fingerprint=fingerprint,
                max_payload_bytes=10**8,
                timeout=10,
                transport=member_transport,
            )
        assert impostor.value.reason == "unauthenticated_peer"
        assert stranger.sessions == 0 and stranger_metrics.snapshot()["bytes_received"] == 0

        codes = [member.wait(timeout=300) for member in members]
        assert codes == [0, 0], "\n".join(m.output()[-2000:] for m in members)
        finals = [m.status() for m in members]
        ids = {s["peer_id"] for s in finals}
        for final in finals:
            assert final["security"]["private_run"] and not final["security"]["tls"]
            partners = {h["partner"] for h in final["history"] if h["partner"]}
            assert partners and partners <= ids - {final["peer_id"]}, partners  # members blend, with members only
            assert all(e["peer"] in ids for e in final["exchanges"])  # no exchange record of an intruder
        rejected = finals[0]["rejected_payloads"]
        for reason in ("auth_missing", "auth_bad_mac", "auth_replayed", "auth_stale"):
            assert rejected.get(reason, 0) >= 1, rejected
        for member in members:
            assert value not in member.output()  # the secret is in no log line
            key = member.data_dir / "node_key.pem"
            assert key.stat().st_mode & 0o777 == 0o600
    finally:
        if stranger_server is not None:
            stranger_server.stop(grace=None)
        for member in members:
            member.stop()


def test_tls_peers_exchange_and_a_plaintext_peer_is_refused(bootstrap: Bootstrap, tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    write_ca(certs)
    tls_args = []
    for name in ("a", "b"):
        cert, key = write_node_cert(certs, name, ca_dir=certs)
        tls_args.append(["--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(certs / "ca.pem")])
    common = [*TRAIN, "--steps", "100", "--inner-steps", "20", "--pair-timeout", "4"]
    nodes = [
        NodeProcess("tls0", bootstrap, tmp_path, *common, "--shard-index", "0", *tls_args[0]),
        NodeProcess("tls1", bootstrap, tmp_path, *common, "--shard-index", "1", *tls_args[1]),
        NodeProcess("plain", bootstrap, tmp_path, *common, "--shard-index", "2"),
    ]
    try:
        tls_status = _wait_for(lambda: (s := nodes[0].status()) and s["address"] and s, 120, "tls0")
        plain_status = _wait_for(lambda: (s := nodes[2].status()) and s["address"] and s, 120, "plain")
        fingerprint = tls_status["run_fingerprint"]
        outgoing = payload(node_weights(), run_fingerprint=fingerprint, peer_id="plain-caller", outer_step=1)
        expected = layout_of(node_weights())
        # Plaintext into a TLS node, and TLS into a plaintext node: no connection either way.
        with pytest.raises(ExchangeError) as plain_into_tls:
            exchange_with(
                tls_status["address"],
                outgoing,
                expected,
                run_fingerprint=fingerprint,
                max_payload_bytes=10**8,
                timeout=5,
            )
        assert plain_into_tls.value.code == grpc.StatusCode.UNAVAILABLE
        tls_transport = Transport(tls=TlsFiles(certs / "a.pem", certs / "a.key", certs / "ca.pem"))
        with pytest.raises(ExchangeError) as tls_into_plain:
            exchange_with(
                plain_status["address"],
                outgoing,
                expected,
                run_fingerprint=fingerprint,
                max_payload_bytes=10**8,
                timeout=5,
                transport=tls_transport,
            )
        assert tls_into_plain.value.code == grpc.StatusCode.UNAVAILABLE
        # A TLS client whose certificate another CA signed is refused by the TLS node too.
        other_ca = tmp_path / "other-ca"
        write_ca(other_ca)
        cert, key = write_node_cert(other_ca, "rogue", ca_dir=other_ca)
        with pytest.raises(ExchangeError) as rogue:
            exchange_with(
                tls_status["address"],
                outgoing,
                expected,
                run_fingerprint=fingerprint,
                max_payload_bytes=10**8,
                timeout=5,
                transport=Transport(tls=TlsFiles(cert, key, certs / "ca.pem")),
            )
        assert rogue.value.code == grpc.StatusCode.UNAVAILABLE

        codes = [node.wait(timeout=300) for node in nodes]
        assert codes == [0, 0, 0], "\n".join(n.output()[-2000:] for n in nodes)
        finals = {node.name: node.status() for node in nodes}
        ids = {name: s["peer_id"] for name, s in finals.items()}
        for name in ("tls0", "tls1"):
            security = finals[name]["security"]
            assert security["tls"] and security["mutual_tls"]
            partners = {h["partner"] for h in finals[name]["history"] if h["partner"]}
            other = "tls1" if name == "tls0" else "tls0"
            assert partners == {ids[other]}, partners  # blended with the TLS peer, never with the plaintext one
        assert not any(h["partner"] for h in finals["plain"]["history"])  # nobody would talk to it
        assert finals["plain"]["exchange_outcomes"].get("completed", 0) == 0
    finally:
        stop_all(nodes)


def test_a_node_refuses_to_start_with_a_world_readable_secret(bootstrap: Bootstrap, tmp_path: Path) -> None:
    path = tmp_path / "swarm.secret"
    path.write_text(secrets.token_urlsafe(32))
    os.chmod(path, 0o644)
    node = NodeProcess("careless", bootstrap, tmp_path, *TRAIN, "--steps", "20", "--secret-file", str(path))
    try:
        assert node.wait(timeout=120) == 2
        assert "readable by anyone" in node.output() and path.read_text() not in node.output()
    finally:
        node.stop()


def test_slow_loris_streams_are_cut_and_the_node_serves_again(bootstrap: Bootstrap, tmp_path: Path) -> None:
    node = NodeProcess(
        "target", bootstrap, tmp_path, *TRAIN, "--steps", "100000", "--mode", "overlap", "--max-concurrent-calls", "2"
    )
    try:
        status = _wait_for(lambda: (s := node.status()) and s["address"] and s["inner_step"] > 0 and s, 120, "target")
        address, fingerprint = status["address"], status["run_fingerprint"]
        loris = fresh_identity()  # a key of its own: a slow-loris caller needs no one else's identity

        def manifest_only(key) -> list[bytes]:
            outgoing = payload(node_weights(), run_fingerprint=fingerprint, peer_id=key.peer_id, outer_step=1)
            return [next(iter_frames(outgoing.manifest, outgoing.tensors))]

        release = threading.Event()

        def trickle(first: list[bytes]):
            yield from first
            release.wait(120)  # then nothing: no more bytes, and no deadline set by this caller

        channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        # Two streams of two keys take both exchange slots: one sends nothing, one sends a manifest (and holds a
        # session) then stalls. A second stream of one key is refused at once: one exchange per proven peer.
        second = fresh_identity()
        started = time.monotonic()
        calls = [
            channel.stream_stream(EXCHANGE_METHOD)(
                trickle(frames), metadata=prove(key, EXCHANGE_METHOD, status["peer_id"])
            )
            for key, frames in ((loris, []), (second, manifest_only(second)))
        ]
        _wait_for(lambda: (node.status() or {}).get("calls_in_use", {}).get("exchange") == 2, 30, "both slots held")
        third = fresh_identity()
        code, details = exchange_status(address, manifest_only(third), prove(third, EXCHANGE_METHOD, status["peer_id"]))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "exchange slots" in details, details
        code, details = exchange_status(address, manifest_only(loris), prove(loris, EXCHANGE_METHOD, status["peer_id"]))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "this peer" in details, details
        assert raw_info(address, None) == grpc.StatusCode.OK  # Info has slots of its own: answered all along
        codes = []
        for call in calls:
            with pytest.raises(grpc.RpcError) as cut:
                for _ in call:
                    pass
            codes.append(cut.value.code())
        cut_after = time.monotonic() - started
        assert codes == [grpc.StatusCode.CANCELLED, grpc.StatusCode.CANCELLED]
        assert cut_after < 10  # no byte for --stall-seconds (2 s); the exchange ceiling (60 s) never came into it
        # The address they came from is now served no exchange for a while, whatever key it shows.
        fourth = fresh_identity()
        code, details = exchange_status(
            address, manifest_only(fourth), prove(fourth, EXCHANGE_METHOD, status["peer_id"])
        )
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "stalled" in details, details
        assert raw_info(address, None) == grpc.StatusCode.OK  # and Info is still answered
        release.set()
        channel.close()

        def status_now() -> dict:
            return json.loads(urllib.request.urlopen(f"{status['status_url']}/status", timeout=10).read())

        # The handlers record the cut a moment after the caller sees CANCELLED: wait for both records.
        live = _wait_for(
            lambda: (s := status_now())["exchange_outcomes"].get("cut_stalled", 0) >= 2 and s, 20, "records"
        )
        assert live["inner_step"] > status["inner_step"]  # it trained on throughout
        # One cut before its manifest, one mid-exchange.
        assert live["exchange_outcomes"].get("cut_stalled", 0) == 2, live["exchange_outcomes"]
        assert live["rejected_payloads"].get("admission_barred") == 1, live["rejected_payloads"]
    finally:
        node.stop()
