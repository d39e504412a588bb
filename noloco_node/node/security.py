"""A node's security, assembled from its SecurityConfig: identity, membership, transport and payload admission.

daemon.py holds one :class:`NodeSecurity` and asks it three things: which transport its calls and server use
(plain or TLS, signed or not: transport.py), whether a verified payload may be blended (the norm bound:
payload_guard.py), and whether a peer is refused. Every refusal of a payload's content is counted by reason and
logged once per peer with rate limiting; weights beyond the norm bound set the peer aside for now (drift is not
hostility), anything else quarantines it (peer_policy.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from noloco_node.config.node_config import SecurityConfig
from noloco_node.errors import NolocoError
from noloco_node.pairing.peer_policy import PeerPolicy
from noloco_node.rpc.transport import Transport
from noloco_node.security.auth import CallAuthenticator, SecretError, SwarmSecret, load_secret
from noloco_node.security.identity import IdentityError, NodeIdentity
from noloco_node.security.payload_guard import NORM_BOUND, Complaints, NormGuard, relative_distances
from noloco_node.security.tls import TlsError, TlsFiles
from noloco_node.wire.frames import PayloadError
from noloco_node.wire.payload import Payload

# (partner tensors, own tensors, the tensors whose norm scales the gap, each tensor's name or None): with names, each
# tensor is also held to its own bound (payload_guard.NormGuard.admit)
Comparison = tuple[Sequence[torch.Tensor], Sequence[torch.Tensor], Sequence[torch.Tensor], Sequence[str] | None]
# Measured already: (the overall distance, (name, distance) of each tensor or None)
Distance = tuple[float, Sequence[tuple[str, float]] | None]

log = logging.getLogger(__name__)


class SecuritySetupError(NolocoError):
    """The node's key, secret or TLS files cannot be used; the message says which and why."""


class NodeSecurity:
    def __init__(self, cfg: SecurityConfig, data_dir: Path) -> None:
        self.cfg = cfg
        try:
            self.identity = NodeIdentity.load_or_create(data_dir)
            self.secret: SwarmSecret | None = load_secret(cfg.secret_file)
            tls = (
                TlsFiles(cfg.tls_cert, cfg.tls_key, cfg.tls_ca, cfg.tls_server_name)
                if cfg.tls_cert and cfg.tls_key  # the settings refuse one without the other
                else None
            )
            authenticator = (
                CallAuthenticator(self.secret, self.identity.peer_id, max_clock_skew=cfg.max_clock_skew)
                if self.secret
                else None
            )
            self.transport = Transport(authenticator=authenticator, tls=tls, identity=self.identity)
        except (IdentityError, SecretError, TlsError) as error:
            raise SecuritySetupError(str(error)) from None
        if tls is None and self.secret is not None:
            log.warning("private run without TLS: members are authenticated, but traffic is not encrypted")
        self.norm_guard = NormGuard(fixed=cfg.norm_bound, factor=cfg.norm_bound_factor)
        self.complaints = Complaints()

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    def admit(self, payload: Payload, comparisons: Sequence[Comparison], steps_apart: int | None = None) -> None:
        """Raise PayloadError when the partner's tensors are too far from this node's.

        ``comparisons``: e.g. (their theta, my phi, my phi, the parameter names), (their phi, my phi, my phi, None)
        and (their momentum, my momentum, my phi, None).
        """
        distances: list[Distance] = []
        for theirs, mine, scale, names in comparisons:
            overall, per_tensor = relative_distances(theirs, mine, scale)
            distances.append((overall, None if names is None else list(zip(names, per_tensor, strict=True))))
        self.admit_distances(payload, distances, steps_apart)

    def admit_distances(self, payload: Payload, distances: Sequence[Distance], steps_apart: int | None = None) -> None:
        """As :meth:`admit`, with the distances already measured (chunk by chunk as the payload arrived)."""
        for overall, tensors in distances:
            self.norm_guard.admit(overall, payload.peer_id, steps_apart, tensors)

    def set_aside(self, peer_id: str, reason: str, message: str, policy: PeerPolicy) -> None:
        """A partner whose weights this node would not blend for ``reason`` (too far, or a blend that measured
        worse than none): not called for now, the doubling backoff of a failure; logged, rate limited."""
        avoid = policy.failed(peer_id, reason)
        self.complaints.complain(peer_id, reason, f"{message}; not called for {avoid:.0f}s")

    def bad_payload(self, peer_id: str, error: PayloadError, policy: PeerPolicy) -> None:
        """A payload refused: log it, rate limited; set the peer aside for now (too far: it may have drifted while
        apart from this node) or quarantine it (malformed: no honest peer sends that). The caller counts it."""
        if error.reason == NORM_BOUND:
            self.set_aside(peer_id, NORM_BOUND, error.message, policy)
            return
        policy.quarantine(peer_id, self.cfg.quarantine_seconds, error.reason)
        self.complaints.complain(
            peer_id, error.reason, f"{error.message}; quarantined for {self.cfg.quarantine_seconds:.0f}s"
        )
