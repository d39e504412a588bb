"""A node's peering side, assembled: how it calls peers, when it pairs, and what its gRPC service sees.

- :class:`~noloco_node.pairing.caller.PeerCaller` makes this node's exchange calls, on its own bounded executor;
- the pairing strategy (sync, overlap or stream, :data:`STRATEGIES`) decides when, and offers published copies of the
  weights (:class:`~noloco_node.pairing.strategy.OfferPublisher`);
- :class:`~noloco_node.node.served.ServedNode` answers the peers' calls from the strategy and the latest
  published state;
- :class:`~noloco_node.node.payload_admission.PayloadAdmission` decides, on both sides of an exchange, whether a
  partner's payload may be blended;
- :class:`~noloco_node.security.receipts.ReceiptBook` keeps the receipts of the node's committed exchanges, called
  or served.

They share the node's identity, security, per-peer policy, metrics and receive buffers; nothing here starts a
thread or a task (the daemon does, in its start order).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from threading import Event
from typing import Any

from noloco_node.config.node_config import NodeConfig
from noloco_node.discovery.dht import Discovery
from noloco_node.node.payload_admission import PayloadAdmission
from noloco_node.node.run_layout import RunLayout
from noloco_node.node.security import NodeSecurity
from noloco_node.node.served import ServedNode
from noloco_node.observability.telemetry import Telemetry
from noloco_node.pairing.caller import CallSettings, PeerCaller, PeerPaths
from noloco_node.pairing.overlap import OverlapPairing
from noloco_node.pairing.peer_policy import PeerPolicy
from noloco_node.pairing.standing import Standing
from noloco_node.pairing.strategy import OfferPublisher, PairingContext, PairingStrategy
from noloco_node.pairing.stream import StreamPairing
from noloco_node.pairing.sync import SyncPairing
from noloco_node.rpc.metrics import ExchangeMetrics
from noloco_node.security.receipts import ReceiptBook
from noloco_node.wire import peer_pb2 as pb
from noloco_node.wire.published import LatestSnapshot
from noloco_node.wire.receive_buffers import ReceiveBuffers

STRATEGIES: dict[str, type[PairingStrategy]] = {"sync": SyncPairing, "overlap": OverlapPairing, "stream": StreamPairing}
EXCHANGE_THREADS = 4  # exchanges a node can have in flight at once (one per strategy today, and room)


@dataclass
class Peering:
    caller: PeerCaller
    context: PairingContext
    strategy: PairingStrategy
    served: ServedNode
    admission: PayloadAdmission
    exchanges: ThreadPoolExecutor
    receive_buffers: ReceiveBuffers
    receipts: ReceiptBook

    @classmethod
    def build(
        cls,
        cfg: NodeConfig,
        layout: RunLayout,
        *,
        peer_id: Callable[[], str],
        security: NodeSecurity,
        policy: PeerPolicy,
        standing: Standing,
        metrics: ExchangeMetrics,
        discovery: Discovery,
        telemetry: Telemetry,
        snapshot: LatestSnapshot,
        publish_record: Callable[[], Coroutine[Any, Any, None]],
        stopping: Event,
        info: Callable[[], pb.InfoReply],
        outer_step: Callable[[], int | None],
        reach: PeerPaths,
    ) -> Peering:
        exchanges = ThreadPoolExecutor(EXCHANGE_THREADS, thread_name_prefix="exchange")  # threads start on use
        receive_buffers = ReceiveBuffers(max_idle_bytes=layout.receive_pool_bytes())
        receipts = ReceiptBook(cfg.data_dir)
        admission = PayloadAdmission(
            layout, snapshot=snapshot, security=security, policy=policy, standing=standing, metrics=metrics
        )
        caller = PeerCaller(
            CallSettings(
                run_fingerprint=layout.run_fingerprint,
                kinds={kind.name: kind for kind in layout.payload_kinds()},
                choosing_kind=layout.partner_choosing_kind(),
                max_payload_bytes=layout.max_payload_bytes(),
                max_staleness=cfg.max_staleness,
                transport=security.transport,
                metrics=metrics,
                receive_buffers=receive_buffers,
                receipts=receipts.add,
            ),
            policy,
            standing,
            admit=admission.admit,
            bad_payload=admission.bad_payload,
            observer=admission.value_observer,
            on_peer_step=telemetry.on_live_step,
            on_view=telemetry.on_peers,
            executor=exchanges,
            paths=reach,
        )
        context = PairingContext(
            peer_id=peer_id,
            caller=caller,
            discovery=discovery,
            telemetry=telemetry,
            offers={
                kind.name: OfferPublisher(
                    kind, run_fingerprint=layout.run_fingerprint, peer_id=peer_id, phase_tokens=layout.phase_tokens
                )
                for kind in layout.payload_kinds()
            },
            publish_record=publish_record,
            stopping=stopping,
            pair_timeout=cfg.pair_timeout,
            alone_grace=cfg.alone_grace,
            max_staleness=cfg.max_staleness,
            exchange_ceiling=layout.exchange_ceiling(),
        )
        strategy = STRATEGIES[cfg.mode](context)
        served = ServedNode(
            layout,
            peer_id=peer_id,
            strategy=strategy,
            snapshot=snapshot,
            admission=admission,
            standing=standing,
            receive_buffers=receive_buffers,
            info=info,
            outer_step=outer_step,
            max_staleness=cfg.max_staleness,
        )
        return cls(caller, context, strategy, served, admission, exchanges, receive_buffers, receipts)
