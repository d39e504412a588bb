"""security/payload_seal.py: a sealed payload arrives whole only from the expected sender, for this call, unaltered;
every way of breaking the seal gets its own reason and status. (Against a running node: test_fuzz_payloads.py.)"""

from __future__ import annotations

import grpc
import pytest
import torch

from noloco_node.security.identity import NodeIdentity
from noloco_node.security.payload_seal import PayloadSeal, call_binding
from noloco_node.wire import peer_pb2 as pb
from noloco_node.wire.frames import (
    PayloadError,
    build_manifest,
    chunk_checksum,
    decode_frame,
    encode_chunk_frame,
    iter_frames,
    layout_of,
)
from noloco_node.wire.payload import PayloadReceiver

RUN = "run-seal"
SENDER, RECEIVER, OTHER = NodeIdentity.ephemeral(), NodeIdentity.ephemeral(), NodeIdentity.ephemeral()


def named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [("theta/a", torch.randn(700, generator=g)), ("theta/b", torch.randn(3, 5, generator=g))]


def sealed_frames(signer: NodeIdentity = SENDER, *, binding: str = "nonce-1", to: str | None = None) -> list[bytes]:
    tensors = named()
    manifest = build_manifest(tensors, wire_dtype="bf16", run_fingerprint=RUN, peer_id=SENDER.peer_id, outer_step=2)
    seal = PayloadSeal(signer, peer=to or RECEIVER.peer_id, binding=binding)
    return list(iter_frames(manifest, [t for _, t in tensors], chunk_bytes=400, signer=seal.sign))


def receive(frames: list[bytes], *, binding: str = "nonce-1") -> None:
    check = PayloadSeal(RECEIVER, peer=SENDER.peer_id, binding=binding).check
    receiver = PayloadReceiver(layout_of(named()), run_fingerprint=RUN, max_total_bytes=10**7, seal_check=check)
    for frame in frames:
        receiver.feed(frame)
    receiver.finish().release()


def refusal(frames: list[bytes], **options: str) -> PayloadError:
    with pytest.raises(PayloadError) as refused:
        receive(frames, **options)
    assert not refused.value.blames_sender  # anyone on the path could have done it
    return refused.value


def test_a_sealed_payload_from_the_expected_sender_is_accepted() -> None:
    receive(sealed_frames())


def test_an_unsealed_payload_is_refused() -> None:
    frames = sealed_frames()
    frames[-1] = pb.Frame(end=pb.End(total_bytes=decode_frame(frames[-1]).total_bytes)).SerializeToString()
    error = refusal(frames)
    assert (error.code, error.reason) == (grpc.StatusCode.PERMISSION_DENIED, "unsealed")


def test_a_payload_sealed_by_anyone_else_is_refused_naming_the_signer() -> None:
    error = refusal(sealed_frames(OTHER))
    assert (error.code, error.reason) == (grpc.StatusCode.PERMISSION_DENIED, "wrong_signer")
    assert OTHER.peer_id in error.message


@pytest.mark.parametrize("position", [0, 1, 399])
def test_bytes_altered_after_sealing_are_refused_even_with_a_matching_checksum(position: int) -> None:
    frames = sealed_frames()
    chunk = decode_frame(frames[2])
    content = bytearray(chunk.data)
    content[position] ^= 0x01
    frames[2] = encode_chunk_frame(chunk.tensor_index, chunk.offset, bytes(content), chunk_checksum(bytes(content)))
    error = refusal(frames)
    assert (error.code, error.reason) == (grpc.StatusCode.DATA_LOSS, "bad_seal")


def test_a_seal_from_another_call_or_for_another_receiver_is_refused() -> None:
    assert refusal(sealed_frames(binding="nonce-0")).reason == "bad_seal"  # replayed from an earlier call
    assert refusal(sealed_frames(to=OTHER.peer_id)).reason == "bad_seal"  # sent to someone else, relayed here


def test_the_manifest_is_sealed_too() -> None:
    frames = sealed_frames()
    manifest = pb.Frame.FromString(frames[0])
    manifest.manifest.outer_step += 1  # a stale payload presented as a current one
    assert refusal([manifest.SerializeToString(), *frames[1:]]).reason == "bad_seal"


def test_a_garbled_seal_key_is_refused_precisely() -> None:
    frames = sealed_frames()
    end = decode_frame(frames[-1])
    for key in (b"ssh-foo AAAA", b"garbage", b"x" * 5000):
        garbled = pb.End(total_bytes=end.total_bytes, signature=end.signature, signer_key=key)
        error = refusal([*frames[:-1], pb.Frame(end=garbled).SerializeToString()])
        assert (error.code, error.reason) == (grpc.StatusCode.PERMISSION_DENIED, "wrong_signer")


def test_the_binding_is_the_caller_proofs_nonce() -> None:
    assert call_binding([("noloco-caller-nonce", "abc"), ("other", "x")]) == "abc"
    assert call_binding(None) == "" and call_binding([("x-noloco-nonce", "private-run-mac-nonce")]) == ""
