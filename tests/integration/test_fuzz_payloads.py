"""Fuzzing a running node's Exchange, GetState and Info with hypothesis: malformed, truncated, oversized,
wrong-shape, wrong-dtype, NaN/Inf and huge-norm payloads, malformed quantized chunks (NaN, infinite or negative
scales, codes outside the range, a wrong block count), a payload in another wire dtype (sparse included; a sparse
run takes a sparse payload only from the partner it reserved, so malformed sparse records are fuzzed against the
receiver in tests/unit/test_sparse_wire.py), payloads of another configuration (theta+phi, theta+phi+delta, a
stream run's phi), payloads whose seal fails (none, another key's, bytes altered after sealing, a seal replayed
from another call: security/payload_seal.py), and garbage requests. Every other input is sealed by its sender, as
anyone can seal what it sends, so that its content is what is judged.

Two twin nodes train alone (each on its own DHT) with the same seed, shard and settings; one of them is attacked
while it trains, in overlap mode so that every call reaches payload validation (a sync node refuses calls outside
its pairing rounds before reading them), with the int8 wire dtype (its chunks carry scales and codes to check; the
bf16 path's checks are the same code as the unit tests', tests/unit/test_wire.py). Every input must get a
precise status (never OK for an exchange, never INTERNAL or UNKNOWN), the attacked node must keep training, its
final weights and optimizer state must be bit-identical to its twin's, and its memory must stay bounded. The count
of inputs tried is printed.
"""

from __future__ import annotations

import collections
import json
import os
import struct
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from noloco_node.node.fault_injection import Drill
from noloco_node.rpc.contracts import EXCHANGE_METHOD, GET_STATE_METHOD, INFO_METHOD
from noloco_node.rpc.transport import CHANNEL_OPTIONS
from noloco_node.security.caller_proof import prove
from noloco_node.security.identity import NodeIdentity
from noloco_node.wire import peer_pb2 as pb
from noloco_node.wire import quantize
from noloco_node.wire.frames import (
    MAX_MESSAGE_BYTES,
    build_manifest,
    chunk_checksum,
    decode_frame,
    encode_chunk_frame,
    iter_frames,
)

from .attacker import call_exchange, fresh_identity, node_weights, sealed
from .swarm_harness import Bootstrap, NodeProcess, stop_all

TWIN = [
    *("--model", "tiny", "--seq-len", "64", "--batch-size", "8", "--eval-batches", "2"),
    *("--steps", "200", "--inner-steps", "50", "--shard-index", "0", "--mode", "overlap", "--wire-dtype", "int8"),
    # Bit-identical twins need deterministic training: on a GPU, CUDA's backward kernels sum in no fixed order.
    *("--device", "cpu"),
    # The attack's payloads claim outer step 1 however long it runs: within reach for the whole run, every input
    # reaches the checks this test is about (a slow machine once had the node at step 4 mid-attack: OUT_OF_RANGE).
    *("--max-staleness", "10"),
]
# Steps of 0.15 s (the emulated step time sleeps; the maths is untouched), and the sleeping twins leave the CPU to
# the attacker. The attack starts once the first outer step is done (inner step 50: the norm bound has a phase to
# measure) and took 9-40 s here, depending on the machine's load; both twins hold after inner step HOLD (their
# maths is untouched) until the attack is over, so the attacked node is still in its run, serving, whatever it took.
STEP_SECONDS = 0.15
HOLD = 150
# Examples per kind of input: each mutation is a rule, and a few of its draws show whether the rule holds (16 a
# mutation and 120 requests found nothing these do not).
EXAMPLES_PER_MUTATION = 8
REQUEST_EXAMPLES = 60
# The same draws every run, no example database, no deadline (a call's time is the node's, not hypothesis's).
REPRODUCIBLE: dict = {
    "deadline": None,
    "database": None,
    "derandomize": True,
    "suppress_health_check": list(HealthCheck),
}
WIRE = "int8"
# What a refused input may be answered with: each names what was wrong (the tests check the message too).
PRECISE = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.DATA_LOSS,  # bytes that are not what their sender signed
}
# What a relay or proxy on the path could do to a payload it forwards, and a sender that signs nothing.
SEAL_MUTATIONS = ["unsealed", "wrong_signer", "altered_after_seal", "replayed_seal"]
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
    "bad_scale",
    "bad_code",
    "wrong_block_count",
    "other_wire_dtype",
    "other_parts",
    *SEAL_MUTATIONS,
]


def _live_inner_step(status: dict) -> int:
    with urllib.request.urlopen(f"{status['status_url']}/status", timeout=10) as answer:
        return json.loads(answer.read())["inner_step"]


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

    def frames(
        self, named: list[tuple[str, torch.Tensor]], peer: str, wire_dtype: str = WIRE, **manifest_changes: object
    ) -> list[bytes]:
        manifest = build_manifest(
            named, wire_dtype=wire_dtype, run_fingerprint=self.fingerprint, peer_id=peer, outer_step=1
        )
        for key, value in manifest_changes.items():
            setattr(manifest, key, value)
        return list(iter_frames(manifest, [t for _, t in named], chunk_bytes=16384))

    def sealed_call(
        self, mutation: str, data: st.DataObject, sender: NodeIdentity, target: str
    ) -> tuple[list[bytes], list[tuple[str, str]]]:
        """One call: its frames, sealed by ``sender`` as the mutation has it, and its proof."""
        proof = prove(sender, EXCHANGE_METHOD, target)
        if mutation not in SEAL_MUTATIONS:
            return sealed(self.build(mutation, data, sender.peer_id), sender, target, proof), proof
        scale = data.draw(st.floats(0.98, 1.02))  # varied payloads, all within the norm bound
        frames = self.frames([(n, t * scale) for n, t in self.base], sender.peer_id)
        if mutation == "unsealed":
            return frames, proof
        if mutation == "wrong_signer":  # someone else's seal on the sender's payload
            return sealed(frames, fresh_identity(), target, proof), proof
        if mutation == "replayed_seal":  # sealed for another call of the same sender
            return sealed(frames, sender, target, prove(sender, EXCHANGE_METHOD, target)), proof
        frames = sealed(frames, sender, target, proof)
        at = data.draw(st.sampled_from(range(1, len(frames) - 1)))
        chunk = decode_frame(frames[at])
        content = bytearray(chunk.data)
        # A code byte of the tensor (past its scales) changed to another valid code, the checksum made right: only
        # the seal can tell.
        position = data.draw(st.integers(max(0, len(content) - 64), len(content) - 1))
        content[position] = 1 if content[position] != 1 else 2
        altered = bytes(content)
        frames[at] = encode_chunk_frame(chunk.tensor_index, chunk.offset, altered, chunk_checksum(altered))
        return frames, proof

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
        if mutation == "other_wire_dtype":  # a well-formed payload, in a dtype this run does not use
            scale = draw(st.floats(0.5, 2.0))  # varied payloads: hypothesis stops early on a three-value choice
            wire_dtype = draw(st.sampled_from(["bf16", "fp32", "int4", "sparse"]))
            return self.frames([(n, t * scale) for n, t in base], peer, wire_dtype=wire_dtype)
        if mutation in ("bad_scale", "bad_code"):
            return self._bad_quantized_chunk(mutation, base, data, peer)
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
            "wrong_block_count",
        ):
            if mutation == "wrong_shape":
                specs[index].shape[draw(st.integers(0, len(specs[index].shape) - 1))] += draw(st.integers(1, 3))
            elif mutation == "wrong_dtype":
                specs[index].dtype = draw(st.sampled_from([0, 1, 7]))
            elif mutation == "wrong_block_count":  # a scale more or fewer, or bytes that make no block
                specs[index].num_bytes += draw(st.sampled_from([-4, 4, -1, 1, 4 * 256]))
            elif mutation == "oversized_declared":
                specs[index].num_bytes = draw(st.integers(2**33, 2**62))
            elif mutation == "renamed":
                specs[index].name = draw(st.text(min_size=1, max_size=30))
            elif mutation == "missing_tensor":
                del specs[index]
            else:
                specs.add(name="theta/extra", shape=[4], dtype=pb.WIRE_DTYPE_INT8_BLOCK256, num_bytes=8)
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

    def _bad_quantized_chunk(
        self, mutation: str, base: list[tuple[str, torch.Tensor]], data: st.DataObject, peer: str
    ) -> list[bytes]:
        """A tensor's first chunk (its scales, then codes) with one scale NaN, infinite or negative, or one code
        byte an encoder never writes; the checksum is made right, so only the content is wrong."""
        frames = self.frames(base, peer)
        firsts = [at for at in range(1, len(frames) - 1) if decode_frame(frames[at]).offset == 0]
        at = data.draw(st.sampled_from(firsts))
        chunk = decode_frame(frames[at])
        content = bytearray(chunk.data)
        scale_bytes = 4 * quantize.num_blocks(base[chunk.tensor_index][1].numel())
        if mutation == "bad_scale":
            position = 4 * data.draw(st.integers(0, min(scale_bytes, len(content)) // 4 - 1))
            value = data.draw(st.sampled_from([float("nan"), float("inf"), -float("inf"), -1e-3, -5.0]))
            content[position : position + 4] = struct.pack("<f", value)
        else:
            content[data.draw(st.integers(scale_bytes, len(content) - 1))] = 0x80  # int8 -128
        frames[at] = encode_chunk_frame(
            chunk.tensor_index, chunk.offset, bytes(content), chunk_checksum(bytes(content))
        )
        return frames


@pytest.fixture
def twins(tmp_path: Path):
    peers = []  # one DHT each: the twins must never find each other
    for i in range(2):
        (tmp_path / f"dht{i}").mkdir()
        peers.append(Bootstrap(tmp_path / f"dht{i}"))
    release = tmp_path / "release"
    paced = Drill(step_time_seconds=STEP_SECONDS, hold_after_inner_step=HOLD, release_file=str(release))
    env = paced.environment()
    nodes = [NodeProcess(name, peers[i], tmp_path, *TWIN, env=env) for i, name in enumerate(("attacked", "twin"))]
    yield nodes
    release.touch()  # a test that failed before releasing them
    stop_all(nodes)
    for peer in peers:
        peer.stop()


def test_fuzzed_payloads_are_refused_precisely_and_change_nothing(twins: list[NodeProcess], tmp_path: Path) -> None:
    attacked, twin = twins
    # One fresh key per exchange example (a quarantine would hide what follows), made while the nodes start up, so
    # that the attack runs at full speed while the attacked node trains.
    strangers = [fresh_identity() for _ in range(EXAMPLES_PER_MUTATION * len(MUTATIONS) + REQUEST_EXAMPLES)]
    deadline = time.monotonic() + 120
    while not ((status := attacked.status()) and status["address"] and status["inner_step"] >= 50):
        assert time.monotonic() < deadline and attacked.process.poll() is None, attacked.output()[-3000:]
        time.sleep(0.2)
    address, fingerprint = status["address"], status["run_fingerprint"]
    started_at = _live_inner_step(status)  # status.json moves only at outer steps; /status at every inner step
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
        @settings(max_examples=EXAMPLES_PER_MUTATION, **REPRODUCIBLE)
        @given(data=st.data())
        def one(data: st.DataObject) -> None:
            # A fresh key each time (any stranger can make one and prove it): a quarantine would hide what follows.
            stranger = strangers.pop() if strangers else fresh_identity()
            frames, proof = attack.sealed_call(mutation, data, stranger, target)
            code, details = call_exchange(channel, frames, proof)
            outcomes[(mutation, code.name)] += 1
            if code not in PRECISE or not details:
                bad.append(f"{mutation}: {code.name} {details!r}")

        one()

    @settings(max_examples=REQUEST_EXAMPLES, **REPRODUCIBLE)
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

    attack_started = time.monotonic()
    try:
        for mutation in MUTATIONS:  # each kind of input gets its own search, so none is starved
            exchange(mutation)
        requests()
    finally:
        watching.set()
        watcher.join()
        channel.close()
    tried = sum(outcomes.values())
    attack_seconds = time.monotonic() - attack_started
    ended_at = _live_inner_step(status)  # at HOLD at the latest: the twins are held there until released
    (tmp_path / "release").touch()
    print(
        f"\nfuzz: {tried} inputs tried in {attack_seconds:.1f} s against a node training from inner step {started_at} "
        f"to {ended_at}; by (input, status): {dict(sorted(outcomes.items()))}"
    )
    print(f"fuzz: node RSS {rss[0]:.0f} MB before, max {max(rss):.0f} MB during")
    assert not bad, bad[:20]
    assert tried >= EXAMPLES_PER_MUTATION * len(MUTATIONS) and all(
        code != "OK" for (m, code) in outcomes if m in MUTATIONS
    )
    assert set(m for m, _ in outcomes) >= set(MUTATIONS)  # every kind of input was tried
    assert ended_at > started_at  # it kept training under attack
    assert max(rss) - rss[0] < 100, rss  # bounded: oversized declarations never allocate

    assert attacked.wait(timeout=300) == 0 and twin.wait(timeout=300) == 0, attacked.output()[-3000:]
    final = attacked.status()
    rejected = final["rejected_payloads"] if final else {}
    per_kind = EXAMPLES_PER_MUTATION
    # Most mutations are refused by the node and counted; norm_bound: huge, random and negated weights.
    assert sum(rejected.values()) >= 12 * per_kind and rejected.get("norm_bound", 0) >= 5 * per_kind // 2, rejected
    # NaN and infinite values quantize to NaN or infinite scales: with bad_scale, two mutations' worth of refusals.
    assert rejected.get("bad_scales", 0) >= 2 * per_kind and rejected.get("bad_codes", 0) >= per_kind, rejected
    assert rejected.get("wire_dtype", 0) >= per_kind and rejected.get("checksum", 0) >= 1, rejected
    for reason in ("unsealed", "wrong_signer", "bad_seal"):  # bad_seal: altered after sealing, and replayed
        least = per_kind if reason == "bad_seal" else per_kind // 2
        assert rejected.get(reason, 0) >= least, (reason, sorted(rejected.items()))
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
