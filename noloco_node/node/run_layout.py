"""What a node of a run is, derived from its settings alone: the model, the run's fingerprint, the tensors on the
wire, and the limits that follow from their size (how long an exchange or a state download may take).

Settings are run-wide or local. Run-wide ones (:func:`run_wide_settings`: H, the inner schedule, NoLoCo's alpha,
beta and gamma of Eq. 2-4, the pairing mode, the wire dtype and how often phi crosses, blended momenta) must be
equal on every node, so they are part of the fingerprint: nodes that differ in one live under different DHT keys
and never pair, and each names the setting in its log and /status (discovery/dht.py's start records). Everything
else (batch size, timeouts, the data shard, limits) is a node's own business.

Known before the node trains a step, so that a call arriving while the node starts is refused cleanly, and so that
``export --from swarm`` finds the run by the same fingerprint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from noloco_node.config.models import OuterConfig, TrainConfig
from noloco_node.config.node_config import NodeConfig
from noloco_node.data.corpus import Corpus
from noloco_node.model.run_model import model_source
from noloco_node.model.source import ModelSource, run_fingerprint
from noloco_node.wire import side_info
from noloco_node.wire.codecs import ENCODED_WIRE_DTYPES
from noloco_node.wire.frames import DEFAULT_CHUNK_BYTES, MEETING, PayloadKind, TensorLayout


def run_wide_settings(node_cfg: NodeConfig, train_cfg: TrainConfig, outer_cfg: OuterConfig) -> dict[str, str]:
    """The settings every node of a run must share, by their settings-file names: two nodes that differ in one
    would blend models on different schedules or payloads of different meaning."""
    return {
        "inner_steps": str(train_cfg.inner_steps),
        "batch_size": str(train_cfg.batch_size),  # with seq_len (in the model's identity): tokens per inner step
        "total_steps": str(train_cfg.total_steps),
        "lr": repr(train_cfg.lr),
        "warmup_steps": str(train_cfg.effective_warmup_steps),
        "min_lr_ratio": repr(train_cfg.min_lr_ratio),
        "adam_beta1": repr(train_cfg.adam_beta1),
        "adam_beta2": repr(train_cfg.adam_beta2),
        "alpha": repr(outer_cfg.alpha),
        "beta": repr(outer_cfg.beta),
        "gamma": repr(outer_cfg.effective_gamma),
        "mode": node_cfg.mode,
        "wire_dtype": node_cfg.wire_dtype,
        "blend_momenta": str(node_cfg.blend_momenta).lower(),
        "bucket_records": str(node_cfg.bucket_records),  # where records are looked for (discovery/buckets.py)
    }


def run_identity(
    node_cfg: NodeConfig, train_cfg: TrainConfig, outer_cfg: OuterConfig, corpus: Corpus
) -> tuple[ModelSource, str]:
    """The model a node of these settings trains and its run's fingerprint (the DHT namespace and pairing key)."""
    source = model_source(train_cfg, corpus.vocab_size)
    fingerprint = run_fingerprint(
        source,
        run_name=node_cfg.run_name,
        seed=train_cfg.seed,
        tokenizer=corpus.tokenizer.fingerprint,
        settings=run_wide_settings(node_cfg, train_cfg, outer_cfg),
    )
    return source, fingerprint


@dataclass(frozen=True)
class RunLayout:
    source: ModelSource
    run_fingerprint: str
    start: dict[str, str]  # what the run started from, said to nodes of the same run name (discovery/dht.py)
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    send_phi: bool  # gamma != beta, momenta blended, or stream mode: a partner has our slow weights too
    send_delta: bool  # --blend-momenta: the outer momentum travels too
    wire_dtype: str
    mode: str  # the pairing mode: stream exchanges other payloads than sync and overlap
    exchange_timeout: float
    min_link_rate: float
    phase_tokens: int = 0  # tokens one member trains per inner phase: inner steps x batch size x sequence length

    @classmethod
    def of(cls, node_cfg: NodeConfig, train_cfg: TrainConfig, outer_cfg: OuterConfig, corpus: Corpus) -> RunLayout:
        source, fingerprint = run_identity(node_cfg, train_cfg, outer_cfg, corpus)
        named = source.layout()
        return cls(
            source=source,
            run_fingerprint=fingerprint,
            start={
                **source.start_summary(),
                "tokenizer": corpus.tokenizer.fingerprint,
                "seed": str(train_cfg.seed),
                **run_wide_settings(node_cfg, train_cfg, outer_cfg),
            },
            names=tuple(n for n, _ in named),
            shapes=tuple(s for _, s in named),
            send_phi=outer_cfg.effective_gamma != outer_cfg.beta or node_cfg.blend_momenta or node_cfg.mode == "stream",
            send_delta=node_cfg.blend_momenta,
            wire_dtype=node_cfg.wire_dtype,
            mode=node_cfg.mode,
            exchange_timeout=node_cfg.exchange_timeout,
            min_link_rate=node_cfg.min_link_rate,
            phase_tokens=train_cfg.inner_steps * train_cfg.batch_size * train_cfg.seq_len,
        )

    def _parts(self, *parts: str, side: bool = False) -> tuple[TensorLayout, ...]:
        """The tensors of ``parts``, each parameter's in turn; with ``side``, those the side-information code carries
        name it as their wire dtype (wire/side_info.py ``side_coded``)."""
        return tuple(
            TensorLayout(f"{part}/{name}", shape, "side" if side and side_info.side_coded(shape) else "")
            for part in parts
            for name, shape in zip(self.names, self.shapes, strict=True)
        )

    def payload_kinds(self) -> list[PayloadKind]:
        """What a partner sends in an exchange. ``overlap``: one payload, ``weights`` (theta, with phi and delta when
        the run needs them), in the wire dtype. ``sync``: ``meet``, the reservation (wire/frames.py ``MEETING``), then
        ``weights``. ``stream``: ``phase`` (phi and, with
        --blend-momenta, delta: fixed during the inner phase, streamed while both train, in bf16) and ``progress``
        (Delta = theta - phi at the outer step, in the wire dtype: the only bytes on the critical path). With the
        sparse wire the phase payload is int8, except phi's matrices, which travel in the side-information code
        (pairing/side_phi.py)."""
        momenta = ("delta",) if self.send_delta else ()
        if self.mode == "stream":
            sparse_wire = self.wire_dtype == "sparse"
            phase = self._parts("phi", side=sparse_wire) + self._parts(*momenta)
            return [
                PayloadKind("phase", phase, "int8" if sparse_wire else "bf16"),
                PayloadKind("progress", self._parts("progress"), self.wire_dtype),
            ]
        phi = ("phi",) if self.send_phi else ()
        weights = PayloadKind("weights", self._parts("theta", *phi, *momenta), self.wire_dtype)
        return [MEETING, weights] if self.mode == "sync" else [weights]

    def partner_choosing_kind(self) -> str:
        """The payload kind whose exchange makes the caller a partner (pairing/standing.py weighs it): a sync run's
        meeting and a stream run's phase swap, which reserve the pair, and overlap's weights; the payload of a
        reserved round goes only to the partner its reservation chose."""
        return {"sync": "meet", "stream": "phase"}.get(self.mode, "weights")

    def payload_kind(self, name: str) -> PayloadKind:
        return next(kind for kind in self.payload_kinds() if kind.name == name)

    def exchange_ceiling(self) -> float:
        """The longest an exchange may take: --exchange-timeout, or longer when the largest payload needs it at
        --min-link-rate (both directions share nothing on a full-duplex link, so one payload's time)."""
        payload = max(kind.wire_bytes() for kind in self.payload_kinds())
        return max(self.exchange_timeout, payload / self.min_link_rate + 10.0)

    def stall_seconds(self, configured: float) -> float:
        """How long a served call may move no byte: --stall-seconds, or longer when one chunk at --min-link-rate
        takes more than half of it: progress is counted by whole chunks (up to 1 MiB, or the largest tensor), which
        on a slow link an honest peer sends seconds apart."""
        largest = max(math.prod(shape) for shape in self.shapes) * 4  # fp32, the widest wire dtype
        return max(configured, 2 * min(DEFAULT_CHUNK_BYTES, largest) / self.min_link_rate)

    def download_timeout(self) -> float:
        """The deadline of one state download: the fp32 state (4 model-sized tensors) at --min-link-rate."""
        state = 4 * 4 * sum(math.prod(shape) for shape in self.shapes)
        return max(self.exchange_timeout, state / self.min_link_rate + 10.0)

    def receive_pool_bytes(self) -> int:
        """What the received payloads of one outer step occupy, kept for the next: their wire bytes, for a quantized
        wire dtype also their values decoded to fp32, and in stream mode the partner's theta rebuilt in fp32."""
        total = 0
        for kind in self.payload_kinds():
            decoded = 4 * sum(item.numel for item in kind.layout) if kind.wire_dtype in ENCODED_WIRE_DTYPES else 0
            total += kind.wire_bytes() + decoded
        rebuilt = 4 * sum(math.prod(shape) for shape in self.shapes) if self.mode == "stream" else 0
        return total + rebuilt

    def max_payload_bytes(self) -> int:
        return max(sum(item.numel for item in kind.layout) for kind in self.payload_kinds()) * 4 + 1024
