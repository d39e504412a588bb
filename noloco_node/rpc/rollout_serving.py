"""Serving ``GetRollouts``: a node doing RL post-training hands its rollouts of a recent round to whoever asks
(noloco_node/rl/; SAPO, arXiv 2509.08721: rollouts are shared with the swarm, and each receiver scores them).

The DHT carries only the manifest (the node's newest round, in its record); the rollouts themselves cross here, one
round per call. The reply is small (task references and completion text) and prepared in advance, so the handler
only looks it up. A node that shares no rollouts answers UNIMPLEMENTED; another run's caller FAILED_PRECONDITION; a
round the node no longer holds NOT_FOUND (it is stale: ask for the newest the record names). Calls have slots of
their own (admission.py), so a flood of them never takes an exchange's or Info's.
"""

from __future__ import annotations

from typing import Protocol

import grpc
from google.protobuf.message import DecodeError

from noloco_node.rpc.admission import ROLLOUTS
from noloco_node.rpc.call_gate import CallGate, abort
from noloco_node.rpc.contracts import GET_ROLLOUTS_METHOD
from noloco_node.wire import peer_pb2 as pb


class RolloutSource(Protocol):
    """What the service needs of a node that shares rollouts (rl/rollouts.py's RolloutBook)."""

    run_fingerprint: str

    def batch(self, round_: int) -> pb.RolloutBatch | None:
        """The rollouts of ``round_``, or None when this node no longer holds that round."""


class RolloutServing:
    """The ``GetRollouts`` handler of a node's service."""

    def __init__(self, source: RolloutSource | None, gate: CallGate) -> None:
        self.source = source
        self.gate = gate

    def GetRollouts(self, raw: bytes, context: grpc.ServicerContext) -> pb.RolloutBatch:  # noqa: N802
        if self.source is None:
            self.gate.metrics.rejection("rollouts_not_shared")
            abort(context, grpc.StatusCode.UNIMPLEMENTED, "this node shares no rollouts")
        caller = self.gate.caller(GET_ROLLOUTS_METHOD, context, required=False)
        ticket = self.gate.admit(ROLLOUTS, context, caller)
        try:
            try:
                request = pb.RolloutRequest.FromString(raw)
            except DecodeError:  # parsed here: grpc's own deserializer would answer INTERNAL, and count nothing
                self.gate.metrics.rejection("rollouts_malformed")
                abort(context, grpc.StatusCode.INVALID_ARGUMENT, "malformed RolloutRequest")
            if request.run_fingerprint != self.source.run_fingerprint:
                self.gate.metrics.rejection("rollouts_run")
                abort(context, grpc.StatusCode.FAILED_PRECONDITION, "another run's caller")
            batch = self.source.batch(request.round)
            if batch is None:
                self.gate.metrics.rejection("rollouts_stale")
                abort(context, grpc.StatusCode.NOT_FOUND, f"round {request.round} is not held here (stale)")
            return batch
        finally:
            self.gate.admission.leave(ticket)
