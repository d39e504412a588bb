"""Fuzzing a running node's Exchange, GetState and Info with hypothesis: malformed, truncated, oversized,
wrong-shape, wrong-dtype, NaN/Inf and huge-norm payloads, payloads of another configuration (theta+phi,
theta+phi+delta), and garbage requests.

Two twin nodes train alone (each on its own DHT) with the same seed, shard and settings; one of them is attacked
while it trains, in overlap mode so that every call reaches payload validation (a sync node refuses calls outside
its pairing rounds before reading them). Every input must get a precise status (never OK for an exchange, never
INTERNAL or UNKNOWN), the attacked node must keep training, its final weights and optimizer state must be
bit-identical to its twin's, and its memory must stay bounded. The count of inputs tried is printed.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from noloco_node.rpc import peer_pb2 as pb
from noloco_node.rpc.service import EXCHANGE_METHOD, GET_STATE_METHOD, INFO_METHOD
from noloco_node.rpc.transport import CHANNEL_OPTIONS
from noloco_node.security.caller_proof import prove
from noloco_node.wire.frames import MAX_MESSAGE_BYTES, build_manifest, decode_frame, iter_frames

from .attacker import call_exchange, fresh_identity, node_weights
from .swarm_harness import Bootstrap, NodeProcess

TWIN = [
    *("--model", "tiny", "--seq-len", "64", "--batch-size", "8", "--eval-batches", "2"),
    *("--steps", "700", "--inner-steps", "50", "--shard-index", "0", "--mode", "overlap"),
]
# What a refused input may be answered with: each names what was wrong (the tests check the message too).
PRECISE = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.ABORTED,
}
MUTATIONS = [
    "truncate",
    "flip_chunk_byte",
    "garbage_frames",
    "non_finite",
    "huge_norm",
    "random_model",
    "negated",
    "wrong_shape",
    "wrong_dtype",
    "oversized_declared",
    "oversized_message",
    "wrong_run",
    "missing_tensor",
    "extra_tensor",
    "renamed",
    "swap_chunks",
    "duplicate_chunk",
    "bad_end",
    "empty",
    "other_parts",
]


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


class Attack:
    """Builds one mutated exchange stream from the node's exact layout."""

    def __init__(self, fingerprint: str) -> None:
        self.fingerprint = fingerprint
        self.base = node_weights()

    def frames(self, named: list[tuple[str, torch.Tensor]], peer: str, **manifest_changes: object) -> list[bytes]:
        manifest = build_manifest(
            named, wire_dtype="bf16", run_fingerprint=self.fingerprint, peer_id=peer, outer_step=1
        )
        for key, value in manifest_changes.items():
            setattr(manifest, key, value)
        return list(iter_frames(manifest, [t for _, t in named], chunk_bytes=16384))

    def build(self, mutation: str, data: st.DataObject, peer: str) -> list[bytes]:
        base = [(n, t.clone()) for n, t in self.base]
        draw = data.draw
        if mutation == "empty":
            return []
        if mutation == "garbage_frames":
            return draw(st.lists(st.binary(min_size=0, max_size=3000), min_size=1, max_size=4))
        if mutation == "oversized_message":
            extra = draw(st.integers(1, 2**20))
            return [self.frames(base, peer)[0], b"\x12" + os.urandom(MAX_MESSAGE_BYTES + extra)]
        if mutation == "non_finite":
            index = draw(st.integers(0, len(base) - 1))
            flat = base[index][1].view(-1)
            flat[draw(st.integers(0, flat.numel() - 1))] = draw(
                st.sampled_from([float("nan"), float("inf"), -float("inf")])
            )
            return self.frames(base, peer)
        if mutation == "huge_norm":
            factor = draw(st.floats(50.0, 1e4))
            return self.frames([(n, t * factor) for n, t in base], peer)
        if mutation == "random_model":
            generator = torch.Generator().manual_seed(draw(st.integers(0, 2**32)))
            std = draw(st.floats(0.01, 1.0))
            return self.frames([(n, torch.randn(t.shape, generator=generator) * std) for n, t in base], peer)
        if mutation == "negated":  # at least 1.5x the weights' own norm away from them
            return self.frames([(n, t * draw(st.floats(-2.0, -0.5))) for n, t in base], peer)
        if mutation == "other_parts":  # well-formed, as a node with --gamma != beta or --blend-momenta sends it
            parts = draw(st.sampled_from([("phi",), ("phi", "delta")]))
            scale = draw(st.floats(0.5, 2.0))
            extra = [(f"{part}/{n.split('/', 1)[1]}", t * scale) for part in parts for n, t in base]
            return self.frames([(n, t * scale) for n, t in base] + extra, peer)
        if mutation == "wrong_run":
            frames = self.frames(base, peer)
            frame = pb.Frame.FromString(frames[0])
            frame.manifest.run_fingerprint = draw(st.text(max_size=40))
            return [frame.SerializeToString(), *frames[1:]]
        frames = self.frames(base, peer)
        manifest_frame = pb.Frame.FromString(frames[0])
        specs = manifest_frame.manifest.tensors
        index = draw(st.integers(0, len(specs) - 1))
        if mutation in (
            "wrong_shape",
            "wrong_dtype",
            "oversized_declared",
            "renamed",
            "missing_tensor",
            "extra_tensor",
        ):
            if mutation == "wrong_shape":
                specs[index].shape[draw(st.integers(0, len(specs[index].shape) - 1))] += draw(st.integers(1, 3))
            elif mutation == "wrong_dtype":
                specs[index].dtype = draw(st.sampled_from([0, 1, 7]))
            elif mutation == "oversized_declared":
                specs[index].num_bytes = draw(st.integers(2**33, 2**62))
            elif mutation == "renamed":
                specs[index].name = draw(st.text(min_size=1, max_size=30))
            elif mutation == "missing_tensor":
                del specs[index]
            else:
                specs.add(name="theta/extra", shape=[4], dtype=pb.WIRE_DTYPE_BFLOAT16, num_bytes=8)
            return [manifest_frame.SerializeToString(), *frames[1:]]
        chunks = list(range(1, len(frames) - 1))
        if mutation == "truncate":
            return frames[: draw(st.integers(1, len(frames) - 1))]
        if mutation == "flip_chunk_byte":
            at = draw(st.sampled_from(chunks))
            frame = bytearray(frames[at])
            position = draw(st.integers(0, len(frame) - 1))
            frame[position] ^= draw(st.integers(1, 255))
            return [*frames[:at], bytes(frame), *frames[at + 1 :]]
        if mutation == "swap_chunks":
            # Two chunks of one tensor out of order (chunks of different tensors may interleave: that payload is
            # the same payload, and rightly accepted).
            tensor_of = {at: decode_frame(frames[at]).tensor_index for at in chunks}
            pairs = [(a, b) for a in chunks for b in chunks if a < b and tensor_of[a] == tensor_of[b]]
            first, second = draw(st.sampled_from(pairs))
            frames[first], frames[second] = frames[second], frames[first]
            return frames
        if mutation == "duplicate_chunk":
            at = draw(st.sampled_from(chunks))
            return [*frames[: at + 1], frames[at], *frames[at + 1 :]]
        if mutation == "bad_end":
            end = pb.Frame.FromString(frames[-1])
            end.end.total_bytes += draw(st.integers(1, 10**6))
            return [*frames[:-1], end.SerializeToString()]
        raise AssertionError(mutation)


@pytest.fixture
def twins(tmp_path: Path):
    peers = []  # one DHT each: the twins must never find each other
    for i in range(2):
        (tmp_path / f"dht{i}").mkdir()
        peers.append(Bootstrap(tmp_path / f"dht{i}"))
    nodes = [NodeProcess(name, peers[i], tmp_path, *TWIN) for i, name in enumerate(("attacked", "twin"))]
    yield nodes
    for node in nodes:
        node.stop()
    for peer in peers:
        peer.stop()


def test_fuzzed_payloads_are_refused_precisely_and_change_nothing(twins: list[NodeProcess]) -> None:
    attacked, twin = twins
    # One fresh key per exchange example (a quarantine would hide what follows), made while the nodes start up, so
    # that the attack runs at full speed while the attacked node trains.
    strangers = [fresh_identity() for _ in range(16 * len(MUTATIONS) + 120)]
    deadline = time.monotonic() + 120
    while not ((status := attacked.status()) and status["address"] and status["inner_step"] >= 60):
        assert time.monotonic() < deadline and attacked.process.poll() is None, attacked.output()[-3000:]
        time.sleep(0.2)
    address, fingerprint, started_at = status["address"], status["run_fingerprint"], status["inner_step"]
    target = status["peer_id"]
    attack = Attack(fingerprint)
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    rss = [_rss_mb(attacked.process.pid)]
    watching = threading.Event()

    def watch_memory() -> None:
        while not watching.wait(0.25):
            rss.append(_rss_mb(attacked.process.pid))

    watcher = threading.Thread(target=watch_memory, daemon=True)
    watcher.start()
    outcomes: collections.Counter[tuple[str, str]] = collections.Counter()
    bad: list[str] = []

    def exchange(mutation: str) -> None:
        @settings(
            max_examples=16, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
        )
        @given(data=st.data())
        def one(data: st.DataObject) -> None:
            # A fresh key each time (any stranger can make one and prove it): a quarantine would hide what follows.
            stranger = strangers.pop() if strangers else fresh_identity()
            proof = prove(stranger, EXCHANGE_METHOD, target)
            code, details = call_exchange(channel, attack.build(mutation, data, stranger.peer_id), proof)
            outcomes[(mutation, code.name)] += 1
            if code not in PRECISE or not details:
                bad.append(f"{mutation}: {code.name} {details!r}")

        one()

    @settings(max_examples=120, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(
        raw=st.one_of(
            st.binary(max_size=200),
            st.builds(
                lambda run, tensor, step, offset: pb.StateRequest(
                    run_fingerprint=run, peer_id="fuzz", from_tensor=tensor, outer_step=step, from_offset=offset
                ).SerializeToString(),
                st.sampled_from([fingerprint, "", "0" * 16]),
                st.integers(0, 2**32 - 1),
                st.integers(0, 2**64 - 1),
                st.integers(0, 2**64 - 1),
            ),
        ),
        method=st.sampled_from([GET_STATE_METHOD, INFO_METHOD]),
    )
    def requests(raw: bytes, method: str) -> None:
        # A stranger's own key proves who asks (GetState requires it): the request itself is what is fuzzed.
        asker = strangers.pop() if strangers else fresh_identity()
        call = channel.unary_stream(method)(raw, timeout=20, metadata=prove(asker, method, target))
        try:
            for _ in call:
                pass
            code, details = grpc.StatusCode.OK, "ok"
        except grpc.RpcError as error:
            code, details = error.code(), error.details() or ""
        outcomes[(method.rsplit("/", 1)[1], code.name)] += 1
        if code not in PRECISE | {grpc.StatusCode.OK} or not details:
            bad.append(f"{method}: {code.name} {details!r}")

    try:
        for mutation in MUTATIONS:  # each kind of input gets its own search, so none is starved
            exchange(mutation)
        requests()
    finally:
        watching.set()
        watcher.join()
        channel.close()
    tried = sum(outcomes.values())
    print(f"\nfuzz: {tried} inputs tried against a running node; by (input, status): {dict(sorted(outcomes.items()))}")
    print(f"fuzz: node RSS {rss[0]:.0f} MB before, max {max(rss):.0f} MB during")
    assert not bad, bad[:20]
    assert tried >= 380 and all(code != "OK" for (m, code) in outcomes if m in MUTATIONS)
    assert set(m for m, _ in outcomes) >= set(MUTATIONS)  # every kind of input was tried
    during = attacked.status()
    assert during is not None and during["inner_step"] > started_at  # it kept training under attack
    assert max(rss) - rss[0] < 100, rss  # bounded: oversized declarations never allocate

    assert attacked.wait(timeout=300) == 0 and twin.wait(timeout=300) == 0, attacked.output()[-3000:]
    final = attacked.status()
    rejected = final["rejected_payloads"] if final else {}
    assert sum(rejected.values()) >= 200 and rejected.get("norm_bound", 0) >= 40, rejected  # huge, random, negated
    assert rejected.get("not_finite", 0) >= 16 and rejected.get("checksum", 0) >= 1, rejected
    assert rejected.get("payload_layout", 0) >= 16, rejected
    assert not any(h["partner"] for h in final["history"])  # nothing was ever blended
    mine = torch.load(attacked.data_dir / "checkpoint.pt", weights_only=True)["replica"]
    theirs = torch.load(twin.data_dir / "checkpoint.pt", weights_only=True)["replica"]
    # The process-wide torch RNG differs between any two node processes, attacked or not (something at start-up
    # seeds it; training never draws from it: init forks its own seeded generator, data order is numpy's).
    for state in (mine, theirs):
        del state["rng_cpu"], state["rng_cuda"]
    _assert_identical(mine, theirs)  # weights, slow weights, momentum, Adam state, counters, data positions


def _assert_identical(a: object, b: object, path: str = "replica") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for key in a:
            _assert_identical(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_identical(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)
