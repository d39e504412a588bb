"""What a node of a run is, derived from its settings alone: the model, the run's fingerprint, the tensors on the
wire, and the limits that follow from their size (how long an exchange or a state download may take).

Known before the node trains a step, so that a call arriving while the node starts is refused cleanly, and so that
``export --from swarm`` finds the run by the same fingerprint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from noloco_node.config.models import NodeConfig, OuterConfig, TrainConfig
from noloco_node.data.corpus import Corpus
from noloco_node.model.source import ModelSource, model_source, run_fingerprint
from noloco_node.wire import quantize
from noloco_node.wire.frames import TensorLayout, wire_num_bytes


def run_identity(node_cfg: NodeConfig, train_cfg: TrainConfig, corpus: Corpus) -> tuple[ModelSource, str]:
    """The model a node of these settings trains and its run's fingerprint (the DHT namespace and pairing key)."""
    source = model_source(train_cfg, corpus.vocab_size)
    fingerprint = run_fingerprint(
        source, run_name=node_cfg.run_name, seed=train_cfg.seed, tokenizer=corpus.tokenizer.fingerprint
    )
    return source, fingerprint


@dataclass(frozen=True)
class RunLayout:
    source: ModelSource
    run_fingerprint: str
    start: dict[str, str]  # what the run started from, said to nodes of the same run name (discovery/dht.py)
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    send_phi: bool  # gamma != beta, or momenta blended: a partner needs our slow weights too (the fast path)
    send_delta: bool  # --blend-momenta: the outer momentum travels too
    wire_dtype: str
    exchange_timeout: float
    min_link_rate: float

    @classmethod
    def of(cls, node_cfg: NodeConfig, train_cfg: TrainConfig, outer_cfg: OuterConfig, corpus: Corpus) -> RunLayout:
        source, fingerprint = run_identity(node_cfg, train_cfg, corpus)
        named = source.layout()
        return cls(
            source=source,
            run_fingerprint=fingerprint,
            start={**source.start_summary(), "tokenizer": corpus.tokenizer.fingerprint, "seed": str(train_cfg.seed)},
            names=tuple(n for n, _ in named),
            shapes=tuple(s for _, s in named),
            send_phi=outer_cfg.effective_gamma != outer_cfg.beta or node_cfg.blend_momenta,
            send_delta=node_cfg.blend_momenta,
            wire_dtype=node_cfg.wire_dtype,
            exchange_timeout=node_cfg.exchange_timeout,
            min_link_rate=node_cfg.min_link_rate,
        )

    def expected_layout(self) -> list[TensorLayout]:
        """The tensors of a partner's exchange payload, in order."""
        prefixes = ("theta", *(("phi",) if self.send_phi else ()), *(("delta",) if self.send_delta else ()))
        return [
            TensorLayout(f"{prefix}/{name}", shape)
            for prefix in prefixes
            for name, shape in zip(self.names, self.shapes, strict=True)
        ]

    def exchange_ceiling(self) -> float:
        """The longest an exchange may take: --exchange-timeout, or longer when the payload needs it at
        --min-link-rate (both directions share nothing on a full-duplex link, so one payload's time)."""
        payload = sum(wire_num_bytes(item.numel, self.wire_dtype) for item in self.expected_layout())
        return max(self.exchange_timeout, payload / self.min_link_rate + 10.0)

    def download_timeout(self) -> float:
        """The deadline of one state download: the fp32 state (4 model-sized tensors) at --min-link-rate."""
        state = 4 * 4 * sum(math.prod(shape) for shape in self.shapes)
        return max(self.exchange_timeout, state / self.min_link_rate + 10.0)

    def receive_pool_bytes(self) -> int:
        """What one received payload occupies, kept for the next: its wire bytes, and for a quantized wire dtype
        also its values decoded to fp32."""
        layout = self.expected_layout()
        wire = sum(wire_num_bytes(item.numel, self.wire_dtype) for item in layout)
        decoded = sum(4 * item.numel for item in layout) if quantize.is_quantized(self.wire_dtype) else 0
        return wire + decoded

    def max_payload_bytes(self) -> int:
        return sum(item.numel for item in self.expected_layout()) * 4 + 1024
