"""`noloco-node bench exchange`: how fast two node processes exchange a model, against raw TCP on the same machine.

Two processes each hold the fp32 weights of a named model size (random values of the right shapes) and run the
node's own gRPC service and client (rpc/, wire/) with node keys of their own, so that every call carries a caller
proof and both payloads are sealed (security/payload_seal.py) as between nodes; one calls the other's
``Exchange``, so each direction carries the full payload at once, exactly as a pairing does. The reference is
measured in the same run between two plain Python processes: a socket sending the same number of bytes one way, and
the same both ways at once. The figure is the ratio, so it holds on a noisy machine. Peak RSS of the exchanging
processes is printed next to the payload and model sizes (the receiver should need one payload-sized buffer, no
whole-model copies).
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from noloco_bench.exchange_references import Where, bare_grpc_seconds, enter, raw_tcp_seconds
from noloco_node.config.models import model_config_for
from noloco_node.model.decoder import LlamaDecoder, named_parameters_ordered
from noloco_node.rpc.client import Outgoing, exchange_with
from noloco_node.rpc.contracts import AdmitsEverything
from noloco_node.rpc.metrics import ExchangeMetrics
from noloco_node.rpc.service import start_server
from noloco_node.rpc.state_download import StateDownload
from noloco_node.rpc.transport import Transport
from noloco_node.security.caller_proof import CallerVerifier
from noloco_node.security.identity import NodeIdentity
from noloco_node.security.payload_guard import RunningGap, relative_distance
from noloco_node.wire import peer_pb2 as pb
from noloco_node.wire import quantize, side_info, sparse
from noloco_node.wire.frames import WIRE_DTYPES, TensorLayout, build_manifest, layout_of, wire_num_bytes
from noloco_node.wire.payload import Payload
from noloco_node.wire.receive_buffers import ReceiveBuffers

RUN = "bench-exchange"


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _weights(size: str, vocab: int, seed: int) -> list[tuple[str, torch.Tensor]]:
    with torch.device("meta"):
        model = LlamaDecoder(model_config_for(size, vocab_size=vocab, max_seq_len=128))
    generator = torch.Generator().manual_seed(seed)
    return [(f"theta/{name}", torch.randn(p.shape, generator=generator)) for name, p in named_parameters_ordered(model)]


class _BenchPeer(AdmitsEverything):
    """The served side: the node's exchange service over fixed weights; every exchange is accepted."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], wire_dtype: str, peer_id: str) -> None:
        self.run_fingerprint = RUN
        self.peer_id = peer_id
        self.layout = layout_of(named)
        self.wire_dtype = wire_dtype  # its own and the callers': one run
        manifest = build_manifest(named, wire_dtype=wire_dtype, run_fingerprint=RUN, peer_id=self.peer_id, outer_step=1)
        self._outgoing = Outgoing(manifest, _published(named, wire_dtype))
        self.received = 0
        self.receive_buffers = ReceiveBuffers(max_idle_bytes=self.max_payload_bytes())
        self._references = {name: tensor.reshape(-1) for name, tensor in named}

    def expected_layout(self) -> list[TensorLayout]:
        return self.layout

    def value_observer(self) -> RunningGap:
        """As a node: the norm bound's distance measured chunk by chunk while the payload arrives."""
        return RunningGap(self._references, lambda: None)

    def max_payload_bytes(self) -> int:
        return sum(item.numel for item in self.layout) * 4 + 1024

    def open_session(self, partner_id: str, partner_outer_step: int, kind: str = "weights") -> Any:
        return self

    def outgoing(self) -> Outgoing:
        return self._outgoing

    def complete(self, payload: Payload) -> bool:
        self.received += 1
        payload.release()  # as a node does once it has blended
        return True

    def release(self) -> None:
        pass

    def info(self) -> pb.InfoReply:
        return pb.InfoReply(peer_id=self.peer_id, run_fingerprint=RUN)

    def state_snapshot(self) -> Outgoing:
        return self._state

    def serve_state(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """A joiner's download, one way: the weights in fp32, as a donor serves its snapshot."""
        metadata = json.dumps({"inner_step": 0, "outer_step": 1, "adam_step": 0})
        manifest = build_manifest(
            named, wire_dtype="fp32", run_fingerprint=RUN, peer_id=self.peer_id, outer_step=1, metadata_json=metadata
        )
        self._state = Outgoing(manifest, [t for _, t in named])


def _published(named: list[tuple[str, torch.Tensor]], wire_dtype: str) -> list[torch.Tensor]:
    """The weights as a node publishes them for its exchanges: converted (or quantized) once, streamed as they are;
    sparse top-k coded, as a stream node sends its progress."""
    if wire_dtype == "sparse":
        return [sparse.encode(t) for _, t in named]
    if quantize.is_quantized(wire_dtype):
        return [quantize.quantize(t, wire_dtype) for _, t in named]
    return [t.to(WIRE_DTYPES[wire_dtype][1]) for _, t in named]


def _server_process(
    size: str, vocab: int, wire_dtype: str, chunk_bytes: int, conn: Any, namespace: str | None, host: str
) -> None:
    enter(namespace)
    torch.set_num_threads(1)
    named = _weights(size, vocab, seed=1)
    identity = NodeIdentity.ephemeral()
    peer = _BenchPeer(named, wire_dtype, identity.peer_id)
    peer.serve_state(named)
    baseline = _rss_mb()
    server, port = start_server(
        peer,
        ExchangeMetrics(),
        bind=f"{host}:0",
        chunk_bytes=chunk_bytes,
        transport=Transport(identity=identity),
        verifier=CallerVerifier(identity.peer_id),
    )
    conn.send((port, identity.peer_id))
    conn.recv()  # the client is done
    server.stop(grace=1).wait(5)
    conn.send({"baseline_rss_mb": baseline, "peak_rss_mb": _rss_mb(), "completed": peer.received})


def _client_process(
    size: str,
    vocab: int,
    wire_dtype: str,
    chunk_bytes: int,
    address: str,
    server_peer_id: str,
    repeats: int,
    conn: Any,
    namespace: str | None,
    downloads: bool = True,
) -> None:
    enter(namespace)
    torch.set_num_threads(1)
    named = _weights(size, vocab, seed=2)
    identity = NodeIdentity.ephemeral()
    transport = Transport(identity=identity)
    manifest = build_manifest(named, wire_dtype=wire_dtype, run_fingerprint=RUN, peer_id=identity.peer_id, outer_step=1)
    started = time.perf_counter()
    outgoing = Outgoing(manifest, _published(named, wire_dtype))
    publish_seconds = time.perf_counter() - started
    buffers = ReceiveBuffers(max_idle_bytes=sum(t.numel() for _, t in named) * 6)
    baseline = _rss_mb()
    seconds, norm_seconds, left_seconds = [], [], []
    references = {name: tensor.reshape(-1) for name, tensor in named}
    numel = sum(t.numel() for _, t in named)
    for _ in range(repeats):
        started = time.perf_counter()
        gap = RunningGap(references, lambda: None)  # as a node: the distance measured while the payload arrives
        payload = exchange_with(
            address,
            outgoing,
            layout_of(named),
            run_fingerprint=RUN,
            max_payload_bytes=sum(t.numel() for _, t in named) * 4 + 1024,
            wire_dtype=wire_dtype,
            timeout=600,
            chunk_bytes=chunk_bytes,
            buffers=buffers,
            observer=gap,
            peer=server_peer_id,
            transport=transport,
        )
        seconds.append(time.perf_counter() - started)
        # What is left of the admission check (payload_guard.py) after the last byte: reading the distance.
        started = time.perf_counter()
        assert gap.distances({"theta": numel}) is not None
        left_seconds.append(time.perf_counter() - started)
        # The reference: the same check made after arrival, in one pass over the payload (as before).
        started = time.perf_counter()
        relative_distance(list(payload.tensors.values()), [t for _, t in named])
        norm_seconds.append(time.perf_counter() - started)
        payload.release()
    exchange_peak = _rss_mb()
    download_seconds = []
    for _ in range(repeats if downloads else 0):
        started = time.perf_counter()
        tensors, _ = StateDownload(
            [(n, tuple(t.shape)) for n, t in named], run_fingerprint=RUN, peer_id=identity.peer_id
        ).fetch(address, timeout=600, transport=transport, donor_peer_id=server_peer_id)
        download_seconds.append(time.perf_counter() - started)
        del tensors
    conn.send(
        {
            "seconds": seconds,
            "publish_seconds": publish_seconds,
            "norm_seconds": norm_seconds,
            "norm_left_seconds": left_seconds,
            "download_seconds": download_seconds,
            "baseline_rss_mb": baseline,
            "peak_rss_mb": exchange_peak,
        }
    )


@dataclass
class ExchangeBenchResult:
    payload_bytes: int
    model_fp32_bytes: int
    exchange_seconds: float
    tcp_one_way_seconds: float
    tcp_both_ways_seconds: float
    bare_grpc_seconds: float
    download_seconds: float
    tcp_download_seconds: float
    norm_check_seconds: float  # the check in one pass after arrival (the reference)
    norm_left_seconds: float  # what is left of it after the last byte when it runs chunk by chunk (as nodes do)
    publish_seconds: float  # the weights into their wire dtype, once per outer step (a node's published copy)
    client_extra_rss_mb: float
    server_extra_rss_mb: float
    link_rate: str | None = None

    def report(self, size: str, wire_dtype: str) -> str:
        gb, state_gb = self.payload_bytes / 1e9, self.model_fp32_bytes / 1e9

        def rate(label: str, seconds: float, amount: float = gb, unit: str = "per direction") -> str:
            return f"  {label:<36}{amount / seconds:6.2f} GB/s {unit} ({seconds:.3f} s)"

        lines = [
            f"model {size}: {self.model_fp32_bytes / 1e6:.0f} MB of fp32 weights; exchange payload "
            f"{self.payload_bytes / 1e6:.0f} MB per direction ({wire_dtype} on the wire)",
            "exchange: both directions at once, as a pairing does",
            rate("raw TCP, one way:", self.tcp_one_way_seconds, unit="         "),
            rate("raw TCP, both ways at once:", self.tcp_both_ways_seconds),
            rate("bare gRPC, both ways (no work):", self.bare_grpc_seconds),
            rate("noloco exchange, both ways:", self.exchange_seconds),
            f"  ratio to raw TCP doing the same transfer (both ways):    "
            f"{self.tcp_both_ways_seconds / self.exchange_seconds:.0%}",
            f"  ratio to raw TCP one way, per direction:                 "
            f"{self.tcp_one_way_seconds / self.exchange_seconds:.0%}",
            f"  ratio to raw TCP one way, bytes moved (both directions): "
            f"{2 * self.tcp_one_way_seconds / self.exchange_seconds:.0%}",
            f"  ratio to bare gRPC both ways (gRPC's own ceiling here):  "
            f"{self.bare_grpc_seconds / self.exchange_seconds:.0%}",
            f"  before it, the copy into the wire dtype (once per outer step): {self.publish_seconds:.3f} s",
            "  the norm-bound check runs chunk by chunk as the payload arrives (inside the exchange's time, both "
            f"sides); left after the last byte: {self.norm_left_seconds * 1000:.2f} ms, against "
            f"{self.norm_check_seconds:.3f} s for the same check in one pass after arrival "
            f"({self.norm_check_seconds / self.exchange_seconds:.0%} of the exchange)",
            "state download: one way, fp32 weights, as a joiner fetches a donor's snapshot (GetState)",
            rate("raw TCP, one way:", self.tcp_download_seconds, state_gb, "         "),
            rate("noloco GetState, one way:", self.download_seconds, state_gb, "         "),
            f"  ratio to raw TCP one way:                                "
            f"{self.tcp_download_seconds / self.download_seconds:.0%}",
            *(
                [
                    f"ratio of the exchange to the nominal link rate ({self.link_rate}), per direction: "
                    f"{self.payload_bytes * 8 / self.exchange_seconds / _bits_per_second(self.link_rate):.0%}"
                ]
                if self.link_rate
                else []
            ),
            f"peak RSS added by exchanging: caller {self.client_extra_rss_mb:.0f} MB, served side "
            f"{self.server_extra_rss_mb:.0f} MB (payload {self.payload_bytes / 1e6:.0f} MB, model "
            f"{self.model_fp32_bytes / 1e6:.0f} MB)",
        ]
        return "\n".join(lines)


def run_exchange_bench(
    size: str = "125m",
    *,
    vocab: int = 256,
    wire_dtype: str = "bf16",
    chunk_bytes: int = 2**20,
    repeats: int = 3,
    link_rate: str | None = None,
) -> ExchangeBenchResult:
    """Loopback by default; with ``link_rate`` (e.g. "1gbit") over a veth pair shaped to that rate."""
    if link_rate is None:
        return _run(size, vocab, wire_dtype, chunk_bytes, repeats, ((None, "127.0.0.1"), (None, "127.0.0.1")))
    from noloco_bench.netns import shaped_link

    with shaped_link(link_rate) as link:
        where = ((link.namespaces[0], link.addresses[0]), (link.namespaces[1], link.addresses[1]))
        result = _run(size, vocab, wire_dtype, chunk_bytes, repeats, where)
    result.link_rate = link_rate
    return result


def _bits_per_second(rate: str) -> float:
    """tc's rate syntax: 1gbit, 100mbit, 500kbit."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for suffix, scale in units.items():
        if rate.lower().endswith(suffix):
            return float(rate[: -len(suffix)]) * scale
    raise ValueError(f"unknown rate {rate!r}: use e.g. 1gbit, 100mbit")


def _exchange_processes(
    size: str, vocab: int, wire_dtype: str, chunk_bytes: int, repeats: int, where: Where, *, downloads: bool = True
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A served node process and a calling one on the two ends of ``where``; their reports (client, server)."""
    (server_ns, server_host), (client_ns, _) = where
    ctx = mp.get_context("spawn")
    server_rx, server_tx = ctx.Pipe()
    server = ctx.Process(
        target=_server_process, args=(size, vocab, wire_dtype, chunk_bytes, server_tx, server_ns, server_host)
    )
    server.start()
    port, server_peer_id = server_rx.recv()
    client_rx, client_tx = ctx.Pipe(duplex=False)
    client = ctx.Process(
        target=_client_process,
        args=(
            *(size, vocab, wire_dtype, chunk_bytes, f"{server_host}:{port}", server_peer_id),
            *(repeats, client_tx, client_ns, downloads),
        ),
    )
    client.start()
    client_report = client_rx.recv()
    client.join()
    server_rx.send("stop")
    server_report = server_rx.recv()
    server.join()
    return client_report, server_report


def _payload_bytes(size: str, vocab: int, wire_dtype: str) -> int:
    return sum(wire_num_bytes(t.numel(), wire_dtype) for _, t in _weights_meta(size, vocab))


def _run(size: str, vocab: int, wire_dtype: str, chunk_bytes: int, repeats: int, where: Where) -> ExchangeBenchResult:
    client_report, server_report = _exchange_processes(size, vocab, wire_dtype, chunk_bytes, repeats, where)
    numel = sum(t.numel() for _, t in _weights_meta(size, vocab))
    payload = _payload_bytes(size, vocab, wire_dtype)
    return ExchangeBenchResult(
        payload_bytes=payload,
        model_fp32_bytes=numel * 4,
        exchange_seconds=min(client_report["seconds"]),
        tcp_one_way_seconds=min(raw_tcp_seconds(payload, both_ways=False, where=where) for _ in range(repeats)),
        tcp_both_ways_seconds=min(raw_tcp_seconds(payload, both_ways=True, where=where) for _ in range(repeats)),
        bare_grpc_seconds=bare_grpc_seconds(payload, chunk_bytes, repeats, where),
        download_seconds=min(client_report["download_seconds"]),
        norm_check_seconds=min(client_report["norm_seconds"]),
        norm_left_seconds=min(client_report["norm_left_seconds"]),
        publish_seconds=client_report["publish_seconds"],
        tcp_download_seconds=min(raw_tcp_seconds(numel * 4, both_ways=False, where=where) for _ in range(repeats)),
        client_extra_rss_mb=client_report["peak_rss_mb"] - client_report["baseline_rss_mb"],
        server_extra_rss_mb=server_report["peak_rss_mb"] - server_report["baseline_rss_mb"],
    )


# ---------------------------------------------------------------------------------------------- wire dtypes


@dataclass
class WireDtypeRow:
    wire_dtype: str
    payload_bytes: int  # per direction; in sync mode all of it is on the critical path
    exchange_seconds: float  # best of the repeats, both directions at once
    publish_seconds: float  # into the wire dtype, once per outer step (before the exchange)


@dataclass
class WireDtypeComparison:
    size: str
    link: str
    rows: list[WireDtypeRow]
    tcp_both_ways_seconds: float  # raw TCP moving the first dtype's bytes both ways, same path, same run
    repeats: int
    progress_seconds: float = 0.0  # stream mode: Delta = theta - phi over the model's fp32 weights, on this machine
    parameters: int = 1  # the model's parameter count: bytes per parameter
    tensor_shapes: list[tuple[int, ...]] = field(default_factory=list)  # phi's bytes with the sparse wire

    def report(self) -> str:
        first = self.rows[0]
        lines = [
            f"model {self.size} over {self.link}: one exchange (both directions at once, as a pairing does) in each "
            f"wire dtype, best of {self.repeats}, in this one run",
            "| wire dtype | bytes per direction (all on the critical path) | exchange | with the encode | "
            f"{first.wire_dtype}'s time / this |",
            "|---|---:|---:|---:|---:|",
        ]
        for row in self.rows:
            total = row.exchange_seconds + row.publish_seconds
            lines.append(
                f"| {row.wire_dtype} | {row.payload_bytes / 1e6:.3f} MB | {row.exchange_seconds:.3f} s | "
                f"{total:.3f} s | {(first.exchange_seconds + first.publish_seconds) / total:.2f}x |"
            )
        lines.append(
            f"reference: raw TCP moving {first.wire_dtype}'s {first.payload_bytes / 1e6:.3f} MB both ways at once on "
            f"the same path: {self.tcp_both_ways_seconds:.3f} s; the {first.wire_dtype} exchange runs at "
            f"{self.tcp_both_ways_seconds / first.exchange_seconds:.0%} of it"
        )
        lines += self._modes_report()
        return "\n".join(lines)

    def _modes_report(self) -> list[str]:
        """Per pairing mode: the bytes of one outer step, those on the critical path, and that path's time, against
        today's default (sync, bf16 theta). In stream mode phi (bf16) crosses during the inner phase and only
        Delta = theta - phi waits for its end; Delta has theta's shapes and codec, so its exchange takes what the
        same wire dtype's exchange took above. With the sparse wire, phi crosses at every phase in the side-information
        code (its matrices; the rest in int8); sync mode refuses int4 and sparse."""
        by_dtype = {row.wire_dtype: row for row in self.rows}
        if "bf16" not in by_dtype:
            return []
        reference = by_dtype["bf16"].exchange_seconds + by_dtype["bf16"].publish_seconds
        lines = [
            "",
            "per pairing mode, one outer step (per direction), against sync with bf16 theta (today's default):",
            "| mode | wire dtype | bytes sent | on the critical path | bytes per parameter (all, critical path) | "
            "critical-path time | sync bf16 / this |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        phi_side = sum(
            wire_num_bytes(math.prod(shape), "side" if side_info.side_coded(shape) else "int8")
            for shape in self.tensor_shapes
        )
        for mode in ("sync", "stream"):
            for row in self.rows:
                if mode == "sync" and row.wire_dtype == "sparse":
                    continue
                critical = row.exchange_seconds + row.publish_seconds
                sent = float(row.payload_bytes)
                if mode == "stream":
                    critical += self.progress_seconds
                    # phi at every phase: bf16, or the side-information code with the sparse wire
                    sent += phi_side if row.wire_dtype == "sparse" else by_dtype["bf16"].payload_bytes
                refused = " (a node refuses it: 4 bits of whole weights cost 1.6%)"
                shown = mode + (refused if mode == "sync" and row.wire_dtype == "int4" else "")
                lines.append(
                    f"| {shown} | {row.wire_dtype} | {sent / 1e6:.3f} MB | {row.payload_bytes / 1e6:.3f} MB | "
                    f"{sent / self.parameters:.3f}, {row.payload_bytes / self.parameters:.3f} | "
                    f"{critical:.2f} s | {reference / critical:.2f}x |"
                )
        phi = by_dtype["bf16"]
        lines.append(
            f"stream: phi ({phi.payload_bytes / 1e6:.1f} MB in bf16) crosses during the inner phase, in "
            f"{phi.exchange_seconds:.2f} s on this path: hidden when the phase lasts at least that long (else the rest "
            f"of it waits at the outer step, while the trainer takes borrowed steps); Delta = theta - phi took "
            f"{self.progress_seconds:.3f} s here (in the critical-path time)"
        )
        if "sparse" in by_dtype:
            lines.append(
                f"stream sparse: phi crosses in the side-information code ({phi_side / 1e6:.2f} MB) during the inner "
                "phase; the progress's top-k encode is in the critical-path time"
            )
        return lines


def run_wire_dtype_comparison(
    size: str,
    wire_dtypes: list[str],
    *,
    vocab: int = 256,
    chunk_bytes: int = 2**20,
    repeats: int = 2,
    link_rate: str | None = None,
    rtt_ms: float | None = None,
) -> WireDtypeComparison:
    """Each wire dtype's exchange on the same path in one run: loopback; a veth pair shaped to ``link_rate``; or,
    with ``rtt_ms``, two hosts of the shaped network of ``bench sync`` (``link_rate`` up and down each, the round
    trip added by its delay router)."""
    with _path(link_rate, rtt_ms) as (where, link):
        rows = []
        for wire_dtype in wire_dtypes:
            client, _ = _exchange_processes(size, vocab, wire_dtype, chunk_bytes, repeats, where, downloads=False)
            rows.append(
                WireDtypeRow(
                    wire_dtype,
                    _payload_bytes(size, vocab, wire_dtype),
                    min(client["seconds"]),
                    client["publish_seconds"],
                )
            )
        tcp = min(raw_tcp_seconds(rows[0].payload_bytes, both_ways=True, where=where) for _ in range(repeats))
    shapes = [tuple(t.shape) for _, t in _weights_meta(size, vocab)]
    return WireDtypeComparison(
        size,
        link,
        rows,
        tcp,
        repeats,
        _progress_seconds(size, vocab),
        sum(math.prod(shape) for shape in shapes),
        tensor_shapes=shapes,
    )


def _progress_seconds(size: str, vocab: int) -> float:
    """What stream mode adds to the outer step before its encode: Delta = theta - phi over the fp32 weights."""
    shapes = [tuple(t.shape) for _, t in _weights_meta(size, vocab)]
    theta = [torch.randn(shape) for shape in shapes]
    phi = [torch.randn(shape) for shape in shapes]
    started = time.perf_counter()
    progress = [t - p for t, p in zip(theta, phi, strict=True)]
    seconds = time.perf_counter() - started
    del progress
    return seconds


@contextmanager
def _path(link_rate: str | None, rtt_ms: float | None) -> Iterator[tuple[Where, str]]:
    if rtt_ms is not None:
        if link_rate is None:
            raise ValueError("--rtt-ms needs --link-rate (the bandwidth of each host's link)")
        from noloco_bench.shaped_network import shaped_network

        rate_mbit = _bits_per_second(link_rate) / 1e6
        with shaped_network(2, rate_mbit=rate_mbit, rtt_ms=rtt_ms, prefix="nlx") as net:
            where = ((net.namespace(0), net.address(0)), (net.namespace(1), net.address(1)))
            yield where, f"two hosts on {link_rate} links (up and down) with a {rtt_ms:g} ms round trip"
    elif link_rate is not None:
        from noloco_bench.netns import shaped_link

        with shaped_link(link_rate) as link:
            yield (
                ((link.namespaces[0], link.addresses[0]), (link.namespaces[1], link.addresses[1])),
                (f"a veth pair shaped to {link_rate}"),
            )
    else:
        yield ((None, "127.0.0.1"), (None, "127.0.0.1")), "loopback"


def _weights_meta(size: str, vocab: int) -> list[tuple[str, torch.Tensor]]:
    with torch.device("meta"):
        model = LlamaDecoder(model_config_for(size, vocab_size=vocab, max_seq_len=128))
    return list(named_parameters_ordered(model))
