"""What a run trains: the network, where its first weights come from, and what of it enters the run's identity.

Every part of the node that needs "the model" asks a :class:`ModelSource`: the replica for its initial weights
(training/replica.py), the run layout for the names and shapes on the wire (node/run_layout.py), the fingerprint
for what peers must share (:func:`run_fingerprint`), and ``export`` for the folder it writes (model/export.py).
Pairing, the wire and the outer step (arXiv 2506.10911, eq. 3-5) only ever see named fp32 tensors, whichever
source they came from.

Two kinds of source:

- :class:`SeededDecoder`: this project's Llama-style decoder at a named size, its weights drawn from the run's seed
  (the paper's setting: every replica starts from the same random initialisation);
- a local Hugging Face folder given with ``--init-from`` (model/pretrained.py): a Llama this project's decoder can
  represent loads into it exactly; any other causal LM runs as ``transformers`` builds it.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from noloco_node.config.models import ModelConfig
from noloco_node.data.tokenizer import Tokenizer
from noloco_node.errors import DataError
from noloco_node.model.decoder import CausalLM, LlamaDecoder, named_parameters_ordered, rotary_tables

if TYPE_CHECKING:
    pass

Layout = list[tuple[str, tuple[int, ...]]]


class ModelSource(ABC):
    """A run's model: how to build it, its first weights, its identity, and the Hugging Face folder it exports to."""

    vocab_size: int
    max_seq_len: int

    @property
    @abstractmethod
    def name(self) -> str:
        """Short, for logs and /status: ``tiny``, ``Qwen2ForCausalLM``."""

    @abstractmethod
    def skeleton(self) -> CausalLM:
        """The model on the meta device: its parameter names and shapes, no memory."""

    @abstractmethod
    def initial_model(self, device: torch.device) -> CausalLM:
        """The model every replica of the run starts from, fp32, on ``device``."""

    @abstractmethod
    def with_weights(self, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> CausalLM:
        """The model (on the host, fp32) holding these weights, in :meth:`layout`'s names; checked before copying."""

    @abstractmethod
    def identity(self) -> dict[str, Any]:
        """What peers must share, beyond the run's name, seed and tokenizer: it goes into the run's fingerprint."""

    @abstractmethod
    def record(self) -> dict[str, Any]:
        """JSON that :func:`source_from_record` turns back into this source (kept in checkpoints and exports)."""

    @abstractmethod
    def export_config(self, tokenizer: Tokenizer, dtype: str) -> dict[str, Any]:
        """The ``config.json`` of an exported folder: ``transformers`` builds this model from it."""

    @abstractmethod
    def hf_name(self, name: str) -> str:
        """A parameter's name in the exported folder (the source architecture's own)."""

    def layout(self) -> Layout:
        """Distinct parameters' names and shapes, in the order the outer state, checkpoints and the wire use."""
        return [(name, tuple(p.shape)) for name, p in named_parameters_ordered(self.skeleton())]

    def start_summary(self) -> dict[str, str]:
        """The parts of :meth:`identity` a peer can name when it refuses this node (discovery/dht.py)."""
        return {"model": self.name, "config": _digest(self.identity())}


def _digest(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def llama_config(cfg: ModelConfig, tokenizer: Tokenizer, dtype: str = "fp32") -> dict[str, Any]:
    """The config.json of a LlamaForCausalLM with exactly this model's shape."""
    eos = getattr(tokenizer, "eos_id", None)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        # transformers 4.x reads rope_theta; 5.x reads rope_parameters (and still accepts the former)
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": cfg.init_std,
        "bos_token_id": None,
        "eos_token_id": eos,
        "pad_token_id": None,
        "torch_dtype": {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype],
        "use_cache": True,
    }


@torch.no_grad()
def copy_weights(model: nn.Module, names: Sequence[str], tensors: Sequence[torch.Tensor], *, origin: str) -> None:
    """Copy named tensors into ``model``'s distinct parameters; every name and shape is checked before anything is
    copied, so a mismatch changes nothing."""
    params = dict(named_parameters_ordered(model))
    given = dict(zip(names, tensors, strict=True))
    missing, unexpected = sorted(set(params) - set(given)), sorted(set(given) - set(params))
    if missing or unexpected:
        raise DataError(f"{origin}: missing weights {missing[:5]}, unexpected weights {unexpected[:5]}")
    for name, param in params.items():
        if tuple(given[name].shape) != tuple(param.shape):
            raise DataError(f"{origin}: {name} has shape {tuple(given[name].shape)}, the model {tuple(param.shape)}")
    for name, param in params.items():
        param.copy_(given[name].to(param.dtype))


def empty_decoder(cfg: ModelConfig, device: torch.device) -> LlamaDecoder:
    """A LlamaDecoder with uninitialised weights (no time spent drawing random ones that are overwritten at once)
    and its derived RoPE tables computed."""
    with torch.device("meta"):
        model = LlamaDecoder(cfg)
    model = model.to_empty(device=device)
    if cfg.tie_embeddings:  # to_empty makes new parameters: tie them again
        model.lm_head.weight = model.embed_tokens.weight
    cos, sin = rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    return model


class DecoderSource(ModelSource):
    """This project's decoder (model/decoder.py) of a given shape; subclasses say where its first weights come from."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.model_config = cfg
        self.vocab_size = cfg.vocab_size
        self.max_seq_len = cfg.max_seq_len

    def skeleton(self) -> CausalLM:
        with torch.device("meta"):
            return LlamaDecoder(self.model_config)

    def with_weights(self, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> CausalLM:
        model = empty_decoder(self.model_config, torch.device("cpu"))
        copy_weights(model, names, tensors, origin=f"the {self.name} weights")
        return model

    def export_config(self, tokenizer: Tokenizer, dtype: str) -> dict[str, Any]:
        return llama_config(self.model_config, tokenizer, dtype)

    def hf_name(self, name: str) -> str:
        # LlamaForCausalLM's names: the decoder's own, under ``model.`` (lm_head keeps its name).
        return name if name.startswith("lm_head.") else f"model.{name}"


class SeededDecoder(DecoderSource):
    """The decoder at a named size (or any shape), its first weights drawn from the run's seed: every replica of the
    run starts identical without sending a byte."""

    def __init__(self, cfg: ModelConfig, seed: int, size: str = "custom") -> None:
        super().__init__(cfg)
        self.seed = seed
        self.size = size

    @property
    def name(self) -> str:
        return self.size

    def initial_model(self, device: torch.device) -> CausalLM:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model = LlamaDecoder(self.model_config)
        return model.to(device)

    def identity(self) -> dict[str, Any]:
        # The same material as before sources existed, so seeded runs keep their fingerprints.
        return {"model": self.model_config.identity()}

    def record(self) -> dict[str, Any]:
        return {"kind": "seeded", "model_config": self.model_config.identity(), "seed": self.seed, "size": self.size}


def run_fingerprint(
    source: ModelSource,
    *,
    run_name: str,
    seed: int,
    tokenizer: str = "bytes",
    settings: Mapping[str, str] | None = None,
) -> str:
    """The identity of a run: the model source's identity (its config, and for a pretrained start the digest of
    its weights), every parameter's name and shape, the run's name and seed, the tokenizer (by its fingerprint;
    the byte-level default adds nothing) and the run-wide training settings (node/run_layout.py).

    Peers pair only within one fingerprint, so two nodes can never blend weights of different shapes, different
    initialisations, different vocabularies of the same size, or trained on different schedules.
    """
    shapes = [[name, list(shape)] for name, shape in source.layout()]
    identity: dict[str, object] = {**source.identity(), "shapes": shapes, "run": run_name, "seed": seed}
    if tokenizer != "bytes":
        identity["tokenizer"] = tokenizer
    if settings:
        identity["settings"] = dict(settings)
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
