"""The status of one node, as served on `GET /status` and written to `status.json` in its data directory.

This pydantic model is the schema: `noloco-node status --schema` prints it as JSON Schema, and every field carries
its description there. It holds numbers a node already has (no torch work): what it trains, how far it is, how
well it learns, how much it talks to whom, and a health verdict with its reason.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

HealthState = Literal["starting", "training", "degraded", "failed", "stopping", "finished"]


class Health(BaseModel):
    state: HealthState = Field(description="starting, training, degraded, failed, stopping or finished.")
    reason: str = Field(description="Why, in words: 'no peers for 10 min', 'trainer thread died: ...'.")
    ok: bool = Field(description="What GET /healthz answers: true (200) when training and every loop is alive.")

    def __str__(self) -> str:
        return self.state if not self.reason else f"{self.state}: {self.reason}"


class LossPoint(BaseModel):
    """One outer step of a node's curve."""

    inner_step: int
    train_loss: float = Field(description="Mean training loss over the inner phase that ended here.")
    val_loss: float | None = Field(None, description="Validation loss after the outer step.")
    time: float = Field(description="Unix time.")


class TaskStatus(BaseModel):
    """A supervised background task of the node (node/supervisor.py): restarted after a failure, visibly."""

    name: str
    restarts: int = Field(description="Times it failed and was restarted.")
    last_error: str | None = Field(None, description="The last exception it died of.")
    gave_up: bool = Field(False, description="It failed too often in a row and is no longer restarted (unhealthy).")


class OuterStepRecord(BaseModel):
    """What happened at one outer step of this node."""

    outer_step: int
    inner_step: int
    train_loss: float
    val_loss: float
    partner: str | None = Field(description="Peer id blended with, or null for a solo step.")
    partner_step: int | None = None
    partner_weight: float | None = Field(
        None,
        description="How many replicas the partner counted as in this blend: 1, or less for a partner without "
        "standing once the node has established peers (pairing/standing.py); null for a solo step.",
    )
    loss_with_partner: float | None = Field(
        None,
        description="The loss check (node/blend_check.py): validation loss of the blend with the partner that "
        "answered; null when none did. A partner whose blend measured worse than the step alone is refused: "
        "partner is then null and val_loss is loss_alone.",
    )
    loss_alone: float | None = Field(
        None,
        description="The loss check: validation loss of this outer step without the partner; null when none answered.",
    )
    train_seconds: float = Field(description="Wall time of the inner phase and of the steps taken while waiting.")
    phase_steps: int | None = Field(
        None,
        description="Inner steps the phase trained (inner_step can also jump: a catch-up adopts a peer's counters).",
    )
    steps_while_waiting: int = Field(
        0, description="Inner steps taken while waiting for the partner (--train-while-waiting), in phase_steps too."
    )
    caught_up: bool = Field(False, description="This outer step ended by adopting a peer's state (a catch-up).")
    rolled_back: bool = Field(
        False,
        description="The state downloaded before this phase went bad in it: the node went back to its own "
        "checkpoint (or the seed) and will not ask that donor again.",
    )
    clock_moved_from: int | None = Field(
        None,
        description="This outer step ended by moving the clock forward from this step to outer_step, weights kept: "
        "at least half of the hosts the node has standing with were beyond reach ahead (a healed split).",
    )
    wait_seconds: float = Field(description="Time the trainer waited for communication at this outer step.")
    blend_seconds: float = Field(
        0.0,
        description="Time the trainer spent on the outer step's own work after the phase (its movement, the blend "
        "and the loss check, the evaluation), the wait for a partner left out.",
    )
    upkeep_seconds: float = Field(
        0.0, description="Trainer time at this outer step outside the wait, blend and evaluation: snapshot, checkpoint."
    )
    movement: float | None = Field(
        None,
        description="This node's own relative movement in the phase, ||theta - phi|| / ||phi||, scaled to H steps "
        "when the phase was shorter (steps borrowed while waiting): the norm bound.",
    )
    phase_lr: float | None = Field(None, description="Mean inner learning rate of the phase.")
    partner_lr: float | None = Field(
        None, description="Largest learning rate a partner within the staleness bound may have trained at."
    )
    time: float


class ExchangeRecord(BaseModel):
    """One exchange this node took part in, as caller or as the called side."""

    peer: str
    role: Literal["caller", "served"]
    outcome: str = Field(description="completed, busy, failed, aborted, refused_payload, timeout, ...")
    seconds: float
    bytes_sent: int
    bytes_received: int
    time: float


class KnownPeer(BaseModel):
    """A peer of the same run as this node sees it: its DHT record, and what its Info call last said."""

    peer_id: str
    address: str
    outer_step: int
    inner_step: int
    ready: bool = Field(description="Ready to pair now (sync) or holding a fresh offer (overlap).")
    record_age_seconds: float = Field(description="Since the peer last wrote its DHT record.")
    health: str | None = Field(None, description="From the peer's Info call; null until one answered.")
    train_loss: float | None = None
    val_loss: float | None = None
    history: list[LossPoint] = Field(default_factory=list, description="The peer's recent curve (from Info).")
    info_age_seconds: float | None = Field(None, description="Since the last Info answer.")


class DiscoveryStatus(BaseModel):
    """Where this node looks for its peers in the DHT (discovery/buckets.py)."""

    level: int = Field(
        description="Its buckets' level: a lookup reads one bucket of 2^level (and its followed peers')."
    )
    estimated_members: int | None = Field(
        description="The swarm's size as its bucket reads estimate it (itself included); null while probing."
    )
    probing: bool = Field(description="It has found nobody yet and probes levels 0, 2, 4, ... for the swarm.")
    in_view: int = Field(description="Peer records in its view: a sample of the swarm past one bucket's size.")


class SecurityStatus(BaseModel):
    """How this node admits peers and payloads (never the secret, nor a key)."""

    private_run: bool = Field(description="A swarm secret is set: calls and DHT records must prove membership.")
    tls: bool = Field(description="gRPC runs over TLS.")
    mutual_tls: bool = Field(description="Peers must present a certificate signed by the run's CA.")
    norm_bound: float | None = Field(
        description="Current bound on a partner's relative L2 distance from this node (None before its first phase)."
    )
    norm_bound_basis: Literal["fixed", "own_movement", "none_yet"] = Field(
        description="Where the bound comes from: configured, or this node's own recent movement (never from peers)."
    )
    last_partner_distance: float | None = Field(description="Relative L2 distance of the last admitted partner.")
    last_partner_tensor_ratio: float | None = Field(
        None,
        description="The last admitted partner's largest tensor distance as a fraction of that tensor's own bound "
        "(at most 1; None until a partner was checked tensor by tensor).",
    )
    established_peers: int = Field(
        0, description="Live peers with standing: seen for --standing-seconds and blended with this node."
    )
    stranger_share: float = Field(0.0, description="Share of outer steps that admit strangers (--stranger-share).")
    stranger_steps: int = Field(
        0, description="Outer steps that admitted strangers while a peer with standing was within reach."
    )


class NodeStatus(BaseModel):
    schema_version: Literal[1] = 1
    peer_id: str
    run_name: str
    run_fingerprint: str
    version: str
    mode: str = Field(description="Pairing mode: sync, overlap or stream.")
    model_size: str
    address: str = Field(description="gRPC address peers dial.")
    reachable: bool = Field(
        description="Peers can dial that address (its own call and a peer's view agree); else it is reached through "
        "the relays it names (discovery/tunnels.py)."
    )
    relays: list[str] = Field(
        default_factory=list, description="An unreachable node: the relays it holds (libp2p ids)."
    )
    relayed_bytes: int = Field(0, description="Bytes this node has carried for others as a relay.")
    tunnels_served: int = Field(0, description="Relayed connections into this node's gRPC server so far.")
    tunnels_opened: int = Field(0, description="Relayed connections this node opened to unreachable peers so far.")
    tunnels_punched: int = Field(
        0, description="Of the tunnels opened or served, those a hole punch made direct (the relay left out)."
    )
    status_url: str = Field(description="Where this endpoint is served.")
    dht_maddrs: list[str] = Field(description="This node's DHT multiaddrs (usable as --bootstrap).")
    started_at: float = Field(description="Unix time the node started.")
    training_started_at: float | None = Field(
        None, description="Unix time its trainer started (after loading and --wait-for-peers); null before."
    )
    uptime_seconds: float
    inner_step: int
    outer_step: int
    total_steps: int
    learning_rate: float | None
    train_loss: float | None = Field(description="Mean training loss over the last inner steps (up to 50).")
    val_loss: float | None = Field(description="Validation loss at the last outer step.")
    val_perplexity: float | None
    tokens_per_second: float | None = Field(description="Training throughput over the last inner steps.")
    grad_norm: float | None = Field(None, description="Mean gradient norm (before clipping) of the last inner steps.")
    step_plan: dict[str, Any] | None = Field(
        None,
        description="How this member runs an inner step: micro_batch, accumulation, compiled, checkpointed, source "
        "(settings, probe or memory model), outer_state_on_device (phi and delta on the GPU, or the host), "
        "memory_bytes and peak_bytes, the probe's tokens_per_second and mfu, notes.",
    )
    comm_wait_fraction: float = Field(description="Share of the trainer's wall time spent waiting on communication.")
    blends: int = Field(0, description="Outer steps this node has blended with a partner since it started.")
    outer_steps_behind: int | None = Field(
        None,
        description="The highest outer step among live peers whose claims count (with standing, once any has it) "
        "minus this node's (0: none ahead; null: no peers).",
    )
    refusing_peers: int = Field(
        0, description="Peers with standing whose last answer among this node's recent exchanges refused it."
    )
    peak_rss_mb: float | None = Field(None, description="The node process's peak resident memory so far, in MB.")
    checkpoint_age_seconds: float | None = Field(description="Since the last checkpoint was written; null: none.")
    bytes_sent: int
    bytes_received: int
    exchange_outcomes: dict[str, int] = Field(description="Exchanges by outcome since start.")
    rejected_payloads: dict[str, int] = Field(description="Refused payloads by reason since start.")
    calls_in_use: dict[str, int] = Field(
        default_factory=dict,
        description="Calls this node's server is serving now, by kind (exchange, download, info, rollouts, "
        "receipts): how many of the slots of each kind are held.",
    )
    background_errors: dict[str, int] = Field(
        default_factory=dict, description="Background work of the pairing strategy that ended with an error, by task."
    )
    receipts: dict[str, int] = Field(
        default_factory=dict,
        description="Exchange receipts since start, by outcome: kept (signed by both partners, in receipts.jsonl "
        "and served over gRPC, GetReceipts), or why a committed exchange left none.",
    )
    exchanges: list[ExchangeRecord] = Field(description="The last exchanges, oldest first (up to 20).")
    peers: list[KnownPeer] = Field(description="Live peers of the run in the DHT, as this node last saw them.")
    discovery: DiscoveryStatus | None = Field(None, description="How it finds them; null before its DHT starts.")
    quarantined_peers: dict[str, str] = Field(
        default_factory=dict,
        description="Peers this node holds quarantined now (a bad payload), with the reason, at most 100: "
        "`noloco-node contributions --url` lists their receipts apart.",
    )
    refused_peers: list[str] = Field(
        default_factory=list,
        description="Nodes of the same run name that started from a different model, tokenizer or seed, and what "
        "differs (they and this node never pair).",
    )
    history: list[OuterStepRecord] = Field(description="The last outer steps, oldest first (up to 200).")
    security: SecurityStatus
    tasks: list[TaskStatus] = Field(default_factory=list, description="The node's supervised background tasks.")
    health: Health
