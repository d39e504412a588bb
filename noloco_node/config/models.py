"""Settings of training and its tools, as pydantic models: one model per concern, unknown keys rejected (the node's
own, how it finds peers, pairs and defends itself: node_config.py).

Every value a user can set is declared here with its bounds, so that a bad setting fails before any work starts,
with a message naming the field (see :func:`format_validation_error`). The NoLoCo defaults are the paper's
(arXiv 2506.10911): alpha 0.5, beta 0.7, gamma = beta, H = 50 inner Adam steps, clipping at 1.0, warmup then
cosine decay to 0.1x the peak learning rate.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from noloco_node import algorithm


class StrictSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(BaseModel):
    """Shape of a decoder: everything that decides the parameter shapes (and so the run fingerprint)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vocab_size: int = Field(256, ge=2, description="Tokenizer vocabulary size.")
    hidden_size: int = Field(64, ge=8)
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int | None = Field(
        None, ge=1, description="Key/value heads (grouped-query attention, as in Llama 3); None: num_heads."
    )
    intermediate_size: int = Field(192, ge=8, description="Width of the SwiGLU feed-forward.")
    max_seq_len: int = Field(128, ge=8, description="Longest sequence the RoPE tables are built for.")
    rope_theta: float = Field(10000.0, gt=0)
    norm_eps: float = Field(1e-5, gt=0)
    tie_embeddings: bool = True
    init_std: float = Field(0.02, gt=0)

    @model_validator(mode="after")
    def _heads_divide_hidden(self) -> ModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError("head dimension (hidden_size / num_heads) must be even for rotary embeddings")
        if self.num_heads % self.kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.kv_heads})")
        return self

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    def identity(self) -> dict[str, object]:
        """The config as a run's identity sees it: unset optional fields left out, so that adding one (as
        num_kv_heads was) keeps the fingerprint of every run that does not use it."""
        return self.model_dump(mode="json", exclude_none=True)


# Architecture of each named size; the vocabulary and sequence length come from the data and training settings.
# 125m/1.3b/6.8b follow the paper (hidden 768/2048/4096, layers 12/24/32, intermediate 3072/8192/16384).
MODEL_SIZES: dict[str, dict[str, int | bool]] = {
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=192, tie_embeddings=True),
    "small": dict(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=704, tie_embeddings=True),
    "125m": dict(hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072, tie_embeddings=False),
    "1.3b": dict(hidden_size=2048, num_layers=24, num_heads=16, intermediate_size=8192, tie_embeddings=False),
    "6.8b": dict(hidden_size=4096, num_layers=32, num_heads=32, intermediate_size=16384, tie_embeddings=False),
}
ModelSize = Literal["tiny", "small", "125m", "1.3b", "6.8b"]


def model_config_for(size: str, *, vocab_size: int, max_seq_len: int, **overrides: object) -> ModelConfig:
    """The ModelConfig of a named size for a given tokenizer vocabulary and sequence length."""
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; choose one of {', '.join(MODEL_SIZES)}")
    return ModelConfig(**{**MODEL_SIZES[size], "vocab_size": vocab_size, "max_seq_len": max_seq_len, **overrides})


class DataConfig(StrictSettings):
    """Where the tokens come from."""

    source: str = Field(
        "stdlib",
        description="'stdlib' (the running interpreter's standard library sources, the embedded default), a folder "
        "written by `noloco-node data prepare`, a .txt/.jsonl/.parquet file or a folder of them, or a pre-tokenized "
        "token file (.npy, or raw .bin/.u16/.u32 with token_dtype).",
    )
    tokenizer: Path | None = Field(
        None,
        description="A Hugging Face tokenizers tokenizer.json (or a folder with one); unset: UTF-8 bytes. A prepared "
        "corpus carries its own.",
    )
    text_field: str = Field("text", min_length=1, description="The field (.jsonl) or column (.parquet) with the text.")
    token_dtype: Literal["uint16", "uint32"] | None = Field(
        None, description="dtype of a raw pre-tokenized token file (.npy files carry their own)."
    )
    vocab_size: int | None = Field(
        None, ge=2, description="Vocabulary of a pre-tokenized file (default: largest token id + 1)."
    )
    max_bytes: int = Field(
        32 * 2**20,
        ge=1024,
        description="Cap on the bytes of text read from the stdlib corpus or a text/jsonl/parquet source (`data "
        "prepare` has its own, unlimited by default).",
    )
    validation_fraction: float = Field(
        0.05, gt=0.0, lt=0.5, description="Share of the documents held out for validation."
    )
    cache_dir: Path | None = Field(
        None,
        description="Where the tokenized default corpus is cached (default: $NOLOCO_CACHE_DIR or "
        "~/.cache/noloco-node).",
    )


# The most sequences a validation batch holds. A node evaluates at every outer step, twice when a partner answered
# (the loss check: node/blend_check.py), so validation sized with a GPU's batch (256 sequences x 8 batches) would
# cost as much as a dozen inner steps' forward passes per outer step; this keeps it a fixed, small share.
EVAL_BATCH_SEQUENCES = 16


class TrainConfig(StrictSettings):
    """The inner phase: Adam without weight decay, clipping, warmup + cosine schedule, evaluation."""

    model_size: ModelSize = Field("tiny", description="Named model size (`noloco-node sizes` lists them).")
    init_from: Path | None = Field(
        None,
        description="A local Hugging Face model folder (config.json, *.safetensors, tokenizer.json) to start from "
        "instead of a named size's random weights; read offline. Its tokenizer is the run's unless data.tokenizer "
        "is given.",
    )
    seq_len: int = Field(128, ge=8, description="Tokens per training sequence.")
    batch_size: int = Field(
        8,
        ge=1,
        description="Sequences per inner step of one replica: with seq_len, the run's tokens per inner step, the same "
        "on every member (part of the run's fingerprint).",
    )
    micro_batch: int | None = Field(
        None,
        ge=1,
        description="Sequences per forward and backward pass; the step accumulates batch_size / micro_batch of them. "
        "Each member's own (not in the fingerprint). Unset: on a GPU the largest that fits with a margin, found by a "
        "probe at start; on a CPU the whole batch.",
    )
    compile: Literal["auto", "on", "off"] = Field(
        "auto", description="torch.compile each decoder block: auto is on for a GPU, off on a CPU."
    )
    activation_checkpointing: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Recompute each block's activations in the backward pass: auto turns it on only where not even "
        "one sequence per micro-batch fits without it.",
    )
    outer_state: Literal["auto", "device", "host"] = Field(
        "auto",
        description="Where a GPU member keeps its outer state (phi and delta, 8 bytes per parameter): auto keeps it "
        "on the GPU when the micro-batch stays what it would be without it, where the outer step is a few passes "
        "over device memory; on the host (pinned) it is bound by the host's memory bandwidth. Each member's own "
        "(not in the fingerprint); a CPU member's is in host memory either way.",
    )
    total_steps: int = Field(600, ge=1, description="Inner steps per replica over the whole run.")
    inner_steps: int = Field(50, ge=1, description="H: inner steps between outer steps.")
    lr: float = Field(3e-3, gt=0.0, le=1.0, description="Peak learning rate of the inner Adam.")
    warmup_steps: int | None = Field(None, ge=0, description="Linear warmup steps (default: 10% of total_steps).")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="Cosine decays to this fraction of the peak.")
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0, description="Inner Adam beta1.")
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0, description="Inner Adam beta2.")
    adam_eps: float = Field(1e-8, gt=0.0, description="Inner Adam epsilon.")
    grad_clip: float = Field(1.0, gt=0.0, description="Gradient norm clipping of every inner step.")
    eval_batches: int = Field(
        8, ge=1, description="Validation batches per evaluation, each of batch_size sequences (at most 16)."
    )
    seed: int = Field(0, ge=0, description="Seed of the run: initial weights, data order, pairings.")
    device: str = Field("auto", description="'auto' (CUDA when available), 'cpu', 'cuda', 'cuda:1', ...")

    @property
    def eval_batch_size(self) -> int:
        """Sequences per validation batch: the training batch's, at most :data:`EVAL_BATCH_SEQUENCES`."""
        return min(self.batch_size, EVAL_BATCH_SEQUENCES)

    @property
    def effective_warmup_steps(self) -> int:
        return self.total_steps // 10 if self.warmup_steps is None else self.warmup_steps

    @model_validator(mode="after")
    def _warmup_fits(self) -> TrainConfig:
        if self.warmup_steps is not None and self.warmup_steps >= self.total_steps > 1:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be < total_steps ({self.total_steps})")
        if self.micro_batch is not None and self.batch_size % self.micro_batch:
            raise ValueError(
                f"micro_batch ({self.micro_batch}) must divide batch_size ({self.batch_size}): every micro-batch of "
                "an inner step holds as many sequences"
            )
        return self


class OuterConfig(StrictSettings):
    """The outer optimizer: NoLoCo's (alpha, beta, gamma) and the DiLoCo baselines' settings."""

    alpha: float = Field(algorithm.NOLOCO_ALPHA, description="NoLoCo outer momentum decay.")
    beta: float = Field(algorithm.NOLOCO_BETA, description="NoLoCo step on the group's mean fast-minus-slow.")
    gamma: float | None = Field(None, description="NoLoCo pull towards the group's mean slow weights (default beta).")
    diloco_alpha: float = Field(
        algorithm.DILOCO_HB_ALPHA, ge=0.0, lt=1.0, description="DiLoCo heavy-ball outer momentum (baselines)."
    )
    diloco_beta: float = Field(
        algorithm.DILOCO_HB_BETA, gt=0.0, description="DiLoCo heavy-ball outer step (baselines)."
    )
    nesterov_lr: float = Field(
        algorithm.DILOCO_NESTEROV_LR, gt=0.0, description="DiLoCo Nesterov outer learning rate (baselines)."
    )
    nesterov_momentum: float = Field(
        algorithm.DILOCO_NESTEROV_MOMENTUM, ge=0.0, lt=1.0, description="DiLoCo Nesterov outer momentum (baselines)."
    )
    diloco_inner_steps: int | None = Field(
        None,
        ge=1,
        description="H of the DiLoCo baselines in simulate (default: twice NoLoCo's H, the paper's terms: about "
        "equal bytes per worker, one model to one peer per H steps against a ring all-reduce's ~2 per 2H).",
    )

    def diloco_h(self, noloco_h: int) -> int:
        """The inner steps between the DiLoCo baselines' outer steps, given NoLoCo's."""
        return self.diloco_inner_steps or 2 * noloco_h

    @property
    def effective_gamma(self) -> float:
        return self.beta if self.gamma is None else self.gamma

    @model_validator(mode="after")
    def _noloco_values_usable(self) -> OuterConfig:
        # Hard errors only; the paper's stability conditions are warnings, emitted by whoever runs NoLoCo.
        algorithm.outer_hyperparameter_warnings(self.alpha, self.beta, self.effective_gamma)
        return self


Method = Literal[
    "noloco",
    "noloco-bf16",
    "noloco-int8",
    "noloco-int4",
    "noloco-stream",
    "noloco-stream-int8",
    "noloco-stream-int4",
    "noloco-sparse-phi1",
    "noloco-sparse-phi8",
    "noloco-sparse-phi16",
    "noloco-sparse-sign-phi16",
    "noloco-sparse-parity-phi16",
    "noloco-sparse-side-ef",
    "noloco-sparse-side-c1",
    "noloco-sparse-side",
    "noloco-sparse-phi1-noef",
    "noloco-late",
    "noloco-late-side",
    "noloco-stale",
    "noloco-momentum",
    "diloco",
    "diloco-nesterov",
    "ddp",
    "solo",
]
ALL_METHODS: tuple[Method, ...] = (
    "noloco",
    "noloco-stale",
    "noloco-momentum",
    "diloco",
    "diloco-nesterov",
    "ddp",
    "solo",
)
# What each wire dtype costs in convergence, on the same seeds: `simulate --compare --methods` with these.
WIRE_METHODS: tuple[Method, ...] = (
    "noloco-bf16",
    "noloco-int8",
    "noloco-int4",
    "noloco-stream",
    "noloco-stream-int8",
    "noloco-stream-int4",
    "noloco-sparse-phi1",
    "noloco-sparse-phi8",
    "noloco-sparse-phi16",
    "noloco-sparse-sign-phi16",
    "noloco-sparse-parity-phi16",
    "noloco-sparse-side-ef",
    "noloco-sparse-side-c1",
    "noloco-sparse-side",
    "noloco-sparse-phi1-noef",
    "noloco-late",
    "noloco-late-side",
)


class SimulateConfig(StrictSettings):
    """An in-process swarm: N replicas, one method or a side-by-side comparison."""

    replicas: int = Field(8, ge=1, le=256)
    methods: list[Method] = Field(default_factory=lambda: list(ALL_METHODS))
    train: TrainConfig = Field(default_factory=TrainConfig)
    outer: OuterConfig = Field(default_factory=OuterConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    out_dir: Path = Path("runs/simulate")


_SENSITIVE_WORDS = ("secret", "password", "token", "key")


def format_validation_error(error: ValidationError, prefix: str = "") -> str:
    """One line per bad field, naming it with its dotted path: ``train.lr: Input should be greater than 0``.

    The offending value is shown, except for fields whose name suggests a secret (and never for a whole section,
    which could hold one)."""
    lines = []
    for item in error.errors():
        location = ".".join(str(part) for part in item["loc"])
        name = f"{prefix}{location}" if location else prefix.rstrip(".") or "config"
        value = item.get("input")
        shown = (
            "" if isinstance(value, dict) or any(w in name.lower() for w in _SENSITIVE_WORDS) else f" (got {value!r})"
        )
        lines.append(f"invalid setting {name}: {item['msg']}{shown}")
    return "\n".join(lines)
