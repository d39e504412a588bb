"""What a stranger (or a hostile member) can send to a node: its exact payload layout, and raw signed calls. The
raw exchange calls and the stranger's keys are the package's outsider's (noloco_bench/outsider.py)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import grpc
import torch

from noloco_bench.outsider import call_exchange, exchange_status, fresh_identity, sealed
from noloco_node.config.models import model_config_for
from noloco_node.model.decoder import LlamaDecoder, named_parameters_ordered
from noloco_node.rpc.client import Outgoing
from noloco_node.rpc.contracts import INFO_METHOD
from noloco_node.rpc.transport import CHANNEL_OPTIONS
from noloco_node.security.auth import MAC_HEADER, NONCE_HEADER, PEER_HEADER, TIME_HEADER, SwarmSecret, _mac
from noloco_node.wire import peer_pb2 as pb
from noloco_node.wire.frames import build_manifest, iter_frames


def node_weights(seq_len: int = 64, seed: int = 0, vocab_size: int = 256) -> list[tuple[str, torch.Tensor]]:
    """The initial weights of a tiny node of the test runs, named as the exchange names them (``theta/...``)."""
    torch.manual_seed(seed)
    model = LlamaDecoder(model_config_for("tiny", vocab_size=vocab_size, max_seq_len=seq_len))
    return [(f"theta/{name}", p.detach().clone()) for name, p in named_parameters_ordered(model)]


def payload(
    named: Sequence[tuple[str, torch.Tensor]],
    *,
    run_fingerprint: str,
    peer_id: str,
    outer_step: int,
    dtype: str = "bf16",
) -> Outgoing:
    manifest = build_manifest(
        named, wire_dtype=dtype, run_fingerprint=run_fingerprint, peer_id=peer_id, outer_step=outer_step
    )
    return Outgoing(manifest, [t for _, t in named])


def signed_metadata(
    secret: SwarmSecret, method: str, *, peer: str, target: str, sent_at_ms: int, nonce: str
) -> list[tuple[str, str]]:
    """Metadata exactly as a member signs it for the server ``target``, with the time and nonce of the test's
    choosing."""
    mac = _mac(secret.key("grpc"), "call", method, peer, target, str(sent_at_ms), nonce)
    return [(PEER_HEADER, peer), (TIME_HEADER, str(sent_at_ms)), (NONCE_HEADER, nonce), (MAC_HEADER, mac)]


def raw_info(address: str, metadata: list[tuple[str, str]] | None) -> grpc.StatusCode:
    """Call Info with exactly this metadata; returns the status code."""
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        info = channel.unary_unary(
            INFO_METHOD,
            request_serializer=pb.InfoRequest.SerializeToString,
            response_deserializer=pb.InfoReply.FromString,
        )
        try:
            info(pb.InfoRequest(), timeout=10, metadata=metadata)
        except grpc.RpcError as error:
            return error.code()
    return grpc.StatusCode.OK


def now_ms() -> int:
    return int(time.time() * 1000)


def frames_of(outgoing: Outgoing) -> list[bytes]:
    return list(iter_frames(outgoing.manifest, outgoing.tensors))


__all__ = [
    "call_exchange",
    "exchange_status",
    "frames_of",
    "fresh_identity",
    "node_weights",
    "now_ms",
    "payload",
    "raw_info",
    "sealed",
    "signed_metadata",
]
