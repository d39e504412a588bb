"""A joiner's download of a donor's outer-step snapshot (GetState), resumable from another donor."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence

import grpc

from noloco_node.rpc.client import ExchangeError, server_problem
from noloco_node.rpc.contracts import GET_STATE_METHOD
from noloco_node.rpc.transport import PLAIN, Transport
from noloco_node.wire import peer_pb2 as pb
from noloco_node.wire.frames import PayloadError, TensorLayout
from noloco_node.wire.payload import PayloadReceiver


class StateDownload:
    """A joiner's download of a donor's outer-step snapshot, resumable chunk-wise from another donor.

    Every chunk is verified as it arrives; when a donor fails mid-transfer, what arrived is kept and the next donor
    is asked for the rest (from the tensor and byte where the first stopped), but only if its snapshot is of the
    same outer step (its counters must match too). The result then holds parts of two replicas of that step, which
    differ only by the swarm's replica spread; another step means starting over: a state is never stitched across
    steps.
    """

    def __init__(self, layout: Sequence[tuple[str, tuple[int, ...]]], *, run_fingerprint: str, peer_id: str) -> None:
        self.expected = [TensorLayout(name, tuple(shape)) for name, shape in layout]
        self.run_fingerprint = run_fingerprint
        self.peer_id = peer_id
        self.done: list = []  # leading tensors received, the last only in part when partial_bytes is not 0
        self.partial_bytes = 0
        self.counters: dict[str, int] | None = None  # of the snapshot being downloaded
        self.resumed = 0  # downloads that continued where another donor stopped
        self.bytes_received = 0  # over every fetch: what a watcher reads as progress
        self._lock = threading.Lock()
        self._call: grpc.Call | None = None
        self._cancelled = False

    def cancel(self) -> None:
        """From any thread: end the fetch in progress (it raises ExchangeError CANCELLED, what arrived kept) and
        refuse any later one. A node that is asked to stop must not wait out a download's deadline."""
        with self._lock:
            self._cancelled = True
            call = self._call
        if call is not None:
            call.cancel()

    def fetch(
        self, address: str, *, timeout: float, transport: Transport = PLAIN, donor_peer_id: str = ""
    ) -> tuple[dict, dict[str, int]]:
        """Download (the rest of) the snapshot of the node ``donor_peer_id`` at ``address``; returns the tensors and
        the counters, or raises ExchangeError with what is complete so far kept for the next donor."""
        max_bytes = sum(item.numel for item in self.expected) * 4 + 1024
        resuming = bool(self.done) and self.counters is not None
        receiver = PayloadReceiver(
            self.expected,
            run_fingerprint=self.run_fingerprint,
            max_total_bytes=max_bytes,
            allowed_dtypes=("fp32",),
            prefilled=self.done if resuming else (),
            prefilled_partial_bytes=self.partial_bytes if resuming else 0,
        )
        request = pb.StateRequest(
            run_fingerprint=self.run_fingerprint,
            peer_id=self.peer_id,
            from_tensor=len(self.done) - (1 if self.partial_bytes else 0) if resuming else 0,
            from_offset=self.partial_bytes if resuming else 0,
            outer_step=self.counters["outer_step"] if resuming and self.counters else 0,
        )
        try:
            with transport.channel(address) as channel:
                get_state = channel.unary_stream(GET_STATE_METHOD, request_serializer=pb.StateRequest.SerializeToString)
                metadata, nonce = transport.sign(GET_STATE_METHOD, donor_peer_id)
                call = get_state(request, timeout=timeout, metadata=metadata)
                with self._lock:
                    self._call = call
                    if self._cancelled:
                        call.cancel()
                if transport.authenticates:
                    problem = server_problem(transport, GET_STATE_METHOD, nonce, call, address)
                    if problem is not None:
                        raise problem
                for frame in call:
                    had_manifest = receiver.manifest is not None
                    receiver.feed(frame)
                    self.bytes_received += len(frame)
                    if not had_manifest and receiver.manifest is not None:
                        self._check_counters(receiver.manifest, address, resuming)
                payload = receiver.finish()
        except PayloadError as error:
            if error.reason == "resume_mismatch":
                self.done, self.partial_bytes = [], 0
            else:
                self._keep(receiver)
            raise ExchangeError(error.code, error.reason, f"bad state from {address}: {error.message}") from None
        except grpc.RpcError as error:
            self._keep(receiver)
            code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
            if resuming and code == grpc.StatusCode.FAILED_PRECONDITION:  # its snapshot is of another step
                self.done, self.partial_bytes, self.counters = [], 0, None
            reason = "busy" if code == grpc.StatusCode.RESOURCE_EXHAUSTED else code.name.lower()
            details = error.details() if hasattr(error, "details") else str(error)
            raise ExchangeError(code, reason, f"{address}: {details}") from None
        finally:
            with self._lock:
                self._call = None
        self.resumed += resuming
        assert self.counters is not None
        return payload.tensors, self.counters

    def _keep(self, receiver: PayloadReceiver) -> None:
        self.done, self.partial_bytes = receiver.received_so_far()

    def _check_counters(self, manifest: pb.Manifest, address: str, resuming: bool) -> None:
        try:
            metadata = json.loads(manifest.metadata_json)
            counters = {key: int(metadata[key]) for key in ("inner_step", "outer_step", "adam_step")}
        except (ValueError, KeyError, TypeError):
            raise PayloadError(
                grpc.StatusCode.INVALID_ARGUMENT, "metadata", f"bad state metadata from {address}"
            ) from None
        if min(counters.values()) < 0 or counters["outer_step"] != manifest.outer_step:
            raise PayloadError(grpc.StatusCode.INVALID_ARGUMENT, "metadata", f"inconsistent counters from {address}")
        if resuming and counters != self.counters:
            self.done, self.partial_bytes, self.counters = [], 0, None  # another step: start over elsewhere
            raise PayloadError(grpc.StatusCode.FAILED_PRECONDITION, "resume_mismatch", f"{address} moved on")
        self.counters = counters
