"""Settings of a swarm member, as pydantic models: how it finds peers, pairs, exchanges, keeps its state
(``NodeConfig``) and defends itself (``SecurityConfig``); bounds and messages as in models.py. Which of these must
match on every node of a run is node/run_layout.py's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from noloco_node.addresses import ip_literal_problem
from noloco_node.config.models import StrictSettings

# discovery/buckets.py: a read moves 5-13 records, about what a lookup in a swarm of 10 moves, so a node among 10,000
# records moves no more than one among 10 (`bench discovery`; at 16 it moved 1.75-2.56x, at 32 3.9x)
DEFAULT_BUCKET_RECORDS = 8

# The NOLOCO_* variables the product reads besides settings (NOLOCO_<SECTION>__<FIELD>, settings.py); any other is
# a typo that would otherwise be ignored in silence.
KNOWN_ENVIRONMENT = {
    "NOLOCO_CACHE_DIR": "where the tokenized default corpus is cached",
    "NOLOCO_SWARM_SECRET": "the swarm secret of a private run (prefer NOLOCO_SWARM_SECRET_FILE)",
    "NOLOCO_SWARM_SECRET_FILE": "a file holding the swarm secret of a private run",
    "NOLOCO_REQUIRE_BROWSER": "tests: fail, rather than skip, the browser test when Chromium is missing (CI)",
    "NOLOCO_REQUIRE_PROMETHEUS": "tests: fail, rather than skip, the Prometheus test when prometheus is missing (CI)",
    "NOLOCO_SCREENSHOT": "tests: where the browser test copies its status-page screenshot",
    "NOLOCO_DRILL": "tests, drills and benchmarks: the faults a node simulates, as JSON (node/fault_injection.py)",
}


PairingMode = Literal["sync", "overlap", "stream"]


class SecurityConfig(StrictSettings):
    """Who may take part in a private run, and what a peer's calls and payloads must pass (auth.py, tls.py,
    payload_guard.py, transport.py). The swarm secret itself is never a setting: it comes from a file or the
    environment (auth.load_secret), so that it appears in no config dump and no process list."""

    secret_file: Path | None = Field(
        None,
        description="File holding the swarm secret of a private run (mode 0600); also $NOLOCO_SWARM_SECRET_FILE "
        "or $NOLOCO_SWARM_SECRET. Without one the run is open to anyone who can reach it.",
    )
    max_clock_skew: float = Field(
        60.0, gt=0, le=3600, description="Largest clock difference (s) a signed call may show; also the replay window."
    )
    tls_cert: Path | None = Field(None, description="PEM certificate of this node (enables TLS for gRPC).")
    tls_key: Path | None = Field(None, description="PEM private key of tls_cert.")
    tls_ca: Path | None = Field(
        None, description="PEM CA of the run: peers' certificates must be signed by it (mutual TLS)."
    )
    tls_server_name: str = Field(
        "noloco-node", min_length=1, description="Name every node's certificate carries and every caller checks."
    )
    norm_bound: float | None = Field(
        None,
        gt=0,
        description="Largest relative L2 distance of a partner's weights from this node's (default: norm_bound_factor "
        "x this node's own largest relative movement over its last 8 inner phases).",
    )
    norm_bound_factor: float = Field(
        3.0, gt=1.0, description="The bound: this many times this node's own recent movement per inner phase."
    )
    quarantine_seconds: float = Field(
        600.0, ge=0, description="How long a peer that sent a refused payload is neither called nor served (s)."
    )
    max_concurrent_calls: int = Field(8, ge=2, le=256, description="Exchanges served at once; more are refused.")
    max_calls_per_address: int = Field(
        4,
        ge=1,
        le=256,
        description="Calls of each kind (exchange, download, Info) served at once to one remote address: one host "
        "cannot take every slot by minting keys.",
    )
    stall_seconds: float = Field(
        2.0,
        gt=0,
        description="A served call that moves no byte for this long is cut, and its peer and address are served no "
        "exchange for 30 s (doubling on each further stall): a caller cannot hold the pairing round silent.",
    )

    @model_validator(mode="after")
    def _tls_files_together(self) -> SecurityConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together")
        if self.tls_ca is not None and self.tls_cert is None:
            raise ValueError("tls_ca needs tls_cert and tls_key: with a CA, peers require this node's certificate")
        return self


class NodeConfig(StrictSettings):
    """A swarm member: how it finds peers, pairs, exchanges and keeps its state."""

    run_name: str = Field("default", min_length=1, max_length=128, description="Part of the run fingerprint.")
    mode: PairingMode = Field(
        "sync",
        description="sync: pair at the outer step and exchange the weights then; stream: choose the partner and "
        "stream the slow weights during the inner phase, and exchange only the phase's progress (theta - phi) at the "
        "outer step; overlap: swap projected weights in the background and never wait (costs convergence).",
    )
    bootstrap: list[str] = Field(
        default_factory=list,
        description="Multiaddrs of DHT peers to join through, or http://HOST:PORT/maddrs of a bootstrap peer's "
        "address book (`bootstrap --http-port`).",
    )
    bootstrap_wait: float = Field(
        120.0, gt=0, description="How long to wait for an http:// bootstrap address book to answer (s)."
    )
    dht_host_maddrs: list[str] = Field(
        default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"], description="Multiaddrs the DHT listens on."
    )
    dht_announce_maddrs: list[str] = Field(
        default_factory=list, description="Multiaddrs other peers should dial to reach this DHT peer (public address)."
    )
    dht_client_mode: bool = Field(
        False, description="Join the DHT as a client only (behind NAT: dial out, serve no DHT requests)."
    )
    check_reachability: bool = Field(
        True,
        description="At start, call this node's own gRPC at the announced address, and ask a peer which address it "
        "sees this node's calls come from and to dial its port back: a node that fails any is reached through relays.",
    )
    relay: bool = Field(
        True,
        description="When reachable, carry tunnels to members that nobody can dial (behind NAT or a firewall), "
        "within --relay-slots and --relay-gb-per-hour; off: this node relays for nobody.",
    )
    relay_slots: int = Field(
        32, ge=1, le=1024, description="Tunnels this node relays at once, at most (each is a peer's kept-open channel)."
    )
    relay_gb_per_hour: float = Field(
        8.0, gt=0, description="Bytes this node relays for others in any hour, at most (GB, both directions)."
    )
    grpc_host: str = Field("127.0.0.1", description="Address the gRPC server binds.")
    grpc_port: int = Field(0, ge=0, lt=65536, description="0: an ephemeral port.")
    announce_host: str | None = Field(
        None,
        description="Host peers should dial (default: grpc_host, or when that is 0.0.0.0 the address of the "
        "default route's interface).",
    )
    announce_port: int | None = Field(None, gt=0, lt=65536, description="Port peers should dial (default: bound).")
    data_dir: Path = Field(Path("noloco-data"), description="Checkpoints and the node's status file.")
    bucket_records: int = Field(
        DEFAULT_BUCKET_RECORDS,
        ge=1,
        le=64,  # a quarter of the entries a DHT peer keeps under one key (discovery/buckets.py): room for floods
        description="Run-wide: the records a DHT bucket holds at the level nodes read; a node reads one bucket (and "
        "its followed peers') per lookup, so its discovery cost stays the same whatever the swarm's size.",
    )
    wait_for_peers: int = Field(
        0,
        ge=0,
        le=1024,
        description="Before the first inner step, wait until this many other nodes of the run are live and each "
        "sees as many (or trains), so that a swarm launched together starts training together (0: start at once).",
    )
    wait_for_peers_timeout: float = Field(
        300.0, gt=0, description="Longest wait for --wait-for-peers; past it the node trains with whoever is there (s)."
    )
    pair_timeout: float = Field(
        10.0,
        gt=0,
        description="sync and stream: how long a node waits for its reserved partner's payload past half a phase or "
        "the inner steps it borrows meanwhile (--train-while-waiting), whichever take longer, before a solo step; "
        "also the longest wait for a reservation in flight when none was made during the phase (s).",
    )
    alone_grace: float = Field(
        1.0,
        ge=0,
        description="sync and stream: wait this long for a late reservation when no partner was reserved during "
        "the phase, before a solo step (s).",
    )
    exchange_timeout: float = Field(
        60.0, gt=0, description="Longest deadline of one exchange call (s); shorter once peers' timings are known."
    )
    min_link_rate: float = Field(
        5e6,
        gt=0,
        description="Slowest link (bytes/s) a peer may have: deadlines never fall below the time a payload or a "
        "state download takes at this rate, whatever exchange_timeout says (a 1.3b payload is 2.6 GB).",
    )
    min_exchange_deadline: float = Field(
        5.0, gt=0, description="Shortest deadline an exchange gets, however fast earlier ones were (s)."
    )
    max_behind: int = Field(
        5,
        ge=0,
        description="A restarted node whose checkpoint is more outer steps behind the swarm downloads state (never "
        "more than max_staleness: a node further behind could pair with nobody).",
    )
    max_state_downloads: int = Field(2, ge=1, description="Joiners served at once; more are told busy.")
    max_staleness: int = Field(2, ge=0, description="Largest outer-step difference with a partner.")
    wire_dtype: Literal["bf16", "fp32", "int8", "int4", "sparse"] = Field(
        "bf16",
        description="Dtype of the exchanged weights on the wire (in stream mode: of the progress theta - phi; phi "
        "streams in bf16): bf16, fp32, or int8/int4 (blockwise absmax, 256 values per fp32 scale; int4 in stream "
        "mode only); sparse (stream mode only): the top 1.56% of each 4,096 values of the progress with 2-bit values, "
        "and phi at every phase in a code read against the receiver's own phi (0.22 bytes a value). Every node of a "
        "run must use the same; a payload in another is refused.",
    )
    blend_momenta: bool = Field(
        False,
        description="Exchange the outer momenta too, and keep the pair's mean of its new ones (\"blend weights and "
        'momenta"). The payload then carries theta, phi and the momentum: 3x the bytes of theta alone, for -0.28% '
        "val loss on the tiny model over 40 outer steps (docs/algorithm-study.md). Every node of a run must use the "
        "same.",
    )
    train_while_waiting: bool = Field(
        True,
        description="sync and stream: while the trainer waits for its partner at an outer step, it goes on taking "
        "inner steps (borrowed from its next phase, which still ends at the same multiple of H) and blends its fresh "
        "weights with the partner's: a partner that finishes its phase later costs this node no idle time. Off: the "
        "trainer idles and blends the weights it sent, exactly.",
    )
    record_ttl: float = Field(
        20.0,
        gt=1.0,
        le=600.0,  # discovery/dht.py MAX_RECORD_TTL: peers refuse records that outlive it
        description="DHT record lifetime (s); refreshed at a third of it.",
    )
    avoid_seconds: float = Field(30.0, ge=0, description="How long a peer that failed is not chosen.")
    standing_seconds: float = Field(
        120.0,
        ge=0,
        description="A peer is a partner (called, and its calls served, on its network group's share) once this "
        "node has seen its DHT record for this long; until then it is a stranger (s).",
    )
    stranger_share: float = Field(
        0.1,
        ge=0,
        le=1,
        description="Share of outer steps in which strangers are called and served, however many keys and addresses "
        "they come from (every step while no peer with standing is in view).",
    )
    checkpoint_every: int = Field(1, ge=1, description="Outer steps between checkpoints.")
    num_shards: int = Field(16, ge=1, description="How many shards the corpus is dealt into.")
    shard_index: int | None = Field(None, ge=0, description="This node's shard (default: from its peer id).")
    torch_threads: int = Field(0, ge=0, description="Torch intra-op threads (0: torch's default).")
    download_state: bool = Field(True, description="Joining a run in progress: download a peer's state.")
    log_every: float = Field(10.0, ge=0, description="Seconds between progress lines (0: one per outer step).")
    status_host: str = Field("127.0.0.1", description="Address the HTTP status endpoint binds (0.0.0.0: public).")
    status_port: int = Field(8470, ge=0, lt=65536, description="HTTP status port (0: an ephemeral port).")
    degraded_after: float = Field(600.0, gt=0, description="Seconds without any live peer before health degrades.")
    stall_after: float = Field(600.0, gt=0, description="Seconds without trainer progress before /healthz answers 503.")
    failure_linger: float = Field(
        60.0, ge=0, description="After the trainer dies, seconds to keep serving status (the reason) before exit."
    )
    security: SecurityConfig = Field(default_factory=SecurityConfig)

    @model_validator(mode="after")
    def _announced_host_is_an_ip(self) -> NodeConfig:
        # The announced host is what the DHT record says, and peers read only canonical IP literals there
        # (noloco_node/addresses.py): a name would make this node unreachable to every peer, silently.
        if self.announce_host is not None:
            field, host = "announce_host", self.announce_host
        elif self.grpc_host not in ("", "0.0.0.0", "::", "[::]"):  # a wildcard announces the detected IP
            field, host = "grpc_host", self.grpc_host
        else:
            return self
        problem = ip_literal_problem(host)
        if problem is not None:
            raise ValueError(f"{field}: {problem}")
        return self

    @model_validator(mode="after")
    def _shard_in_range(self) -> NodeConfig:
        if self.shard_index is not None and self.shard_index >= self.num_shards:
            raise ValueError(f"shard_index ({self.shard_index}) must be < num_shards ({self.num_shards})")
        return self

    @model_validator(mode="after")
    def _int4_carries_progress_only(self) -> NodeConfig:
        # 4 bits of whole weights miss by more than a phase's progress (+1.64% val loss, docs/algorithm-study.md);
        # 4 bits of the progress Delta, which only stream mode sends, cost +0.26%; sparse codes only a progress.
        if self.wire_dtype in ("int4", "sparse") and self.mode != "stream":
            raise ValueError(
                f"wire_dtype {self.wire_dtype} needs mode stream (not {self.mode}): it carries the progress "
                "theta - phi there; on whole weights it costs convergence (use int8, or --mode stream)"
            )
        return self
