"""A local Hugging Face model folder as a run's starting point (``--init-from``), read offline.

A folder in the Hugging Face layout holds ``config.json``, its weights as ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``) and usually ``tokenizer.json``. Two ways to train it, chosen from the config alone
so that every node of a run chooses the same:

- **this project's decoder** (:class:`PretrainedDecoder`), when the config is a Llama it represents exactly
  (RMSNorm, rotate-half RoPE without scaling, SwiGLU, no biases, grouped-query attention allowed): the weights load
  under the decoder's names, the inverse of ``export``;
- **``transformers``' own model** (:class:`TransformersModel`) for any other causal LM that
  ``AutoModelForCausalLM`` builds from its config (Qwen2, Mistral, GPT-2, a Llama with rope scaling...), wrapped so
  that it maps token ids to logits like the decoder; its named parameters are the exchange layout.

The decoder reads the weights tensor by tensor from memory-mapped safetensors into an fp32 model that was never
randomly initialised, so loading costs the model's fp32 size and one tensor more; ``transformers`` models load
through its own ``from_pretrained`` (local files only).

The run's identity (source.py's ``run_fingerprint``) covers the architecture config (without fields that only
record how the file was written) and a digest of the weights themselves, independent of how they are sharded:
a node started from another model, or another revision of it, is in another run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from noloco_node.config.models import ModelConfig
from noloco_node.data.tokenizer import Tokenizer
from noloco_node.errors import DataError
from noloco_node.model.decoder import CausalLM, token_loss
from noloco_node.model.source import DecoderSource, ModelSource, copy_weights, empty_decoder

log = logging.getLogger(__name__)

# config.json fields that say how a file was written, not what the model is: left out of the run's identity.
_NOT_IDENTITY = ("transformers_version", "torch_dtype", "dtype", "_name_or_path", "use_cache")
# Tensors older Llama checkpoints carry that are derived from the config, not weights.
_DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)


# ------------------------------------------------------------------------------------------------ the folder


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise DataError(f"{str(folder)!r} is not a Hugging Face model folder: no config.json")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DataError(f"cannot read {str(path)!r}: {error}") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise DataError(f"{str(path)!r} has no model_type: it is not a transformers config")
    return config


def weight_files(folder: Path) -> list[Path]:
    """The folder's safetensors files: ``model.safetensors``, or the shards its index lists."""
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, KeyError, TypeError, AttributeError, json.JSONDecodeError) as error:
            raise DataError(f"cannot read {str(index)!r}: {error}") from None
        for shard in shards:
            if not (folder / shard).is_file():
                raise DataError(f"{str(folder)!r}: {shard}, listed in {index.name}, is missing")
        return [folder / shard for shard in shards]
    if any(folder.glob("pytorch_model*.bin")):
        raise DataError(
            f"{str(folder)!r} holds pickled pytorch_model.bin weights; this node reads safetensors only (they cannot "
            "run code): save the model with save_pretrained(..., safe_serialization=True)"
        )
    raise DataError(f"{str(folder)!r} has no model.safetensors (nor model.safetensors.index.json)")


class StoredWeights:
    """The folder's tensors, memory-mapped, read one at a time by name (safetensors: no code runs on load)."""

    def __init__(self, files: Sequence[Path]) -> None:
        from safetensors import SafetensorError, safe_open

        self._stack = contextlib.ExitStack()
        self._where: dict[str, Any] = {}
        try:
            for path in files:
                handle = self._stack.enter_context(safe_open(str(path), framework="pt"))
                for name in handle.keys():  # noqa: SIM118 - a safetensors handle is not a dict
                    self._where[name] = handle
        except (SafetensorError, OSError) as error:
            self._stack.close()
            raise DataError(f"cannot read {str(path)!r}: {error}") from None

    def __enter__(self) -> StoredWeights:
        return self

    def __exit__(self, *_: object) -> None:
        self._stack.close()

    def names(self) -> list[str]:
        return sorted(self._where)

    def get(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)


def weights_digest(files: Sequence[Path]) -> str:
    """sha256 of every tensor's name, dtype, shape and bytes, in name order: the same weights give the same digest
    however they are sharded and whatever metadata the files carry."""
    digest = hashlib.sha256()
    with StoredWeights(files) as stored:
        for name in stored.names():
            tensor = stored.get(name).contiguous()
            digest.update(f"{name}|{tensor.dtype}|{list(tensor.shape)}|".encode())
            if tensor.numel():
                digest.update(tensor.view(torch.uint8).numpy().data)
    return digest.hexdigest()


def identity_config(config: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in config.items() if key not in _NOT_IDENTITY}


def _is_derived(name: str) -> bool:
    return name.endswith(_DERIVED_SUFFIXES)


def read_tokenizer_config(folder: Path) -> dict[str, Any] | None:
    path = folder / "tokenizer_config.json"
    try:
        value = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None


# ------------------------------------------------------------------------------------------------ Llama -> decoder


def decoder_config(config: dict[str, Any], origin: str) -> ModelConfig:
    """A Hugging Face Llama config.json as this project's ModelConfig; DataError naming what the decoder does not
    model (then the folder trains through ``transformers`` instead, or, for ``eval`` of a non-Llama, is refused)."""
    if config.get("model_type") != "llama":
        raise DataError(f"{origin}: model_type {config.get('model_type')!r} is not llama")
    heads = config.get("num_attention_heads")
    unsupported = []
    if config.get("attention_bias") or config.get("mlp_bias"):
        unsupported.append("biases")
    if config.get("hidden_act", "silu") != "silu":
        unsupported.append(f"activation {config.get('hidden_act')!r}")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        unsupported.append(f"rope scaling {rope.get('rope_type', rope.get('type'))!r}")
    if isinstance(heads, int) and heads and config.get("head_dim") not in (None, config.get("hidden_size", 0) // heads):
        unsupported.append(f"head_dim {config.get('head_dim')} != hidden_size / num_attention_heads")
    if unsupported:
        raise DataError(f"{origin}: this Llama uses {', '.join(unsupported)}, which LlamaDecoder does not model")
    kv_heads = config.get("num_key_value_heads", heads)
    try:
        return ModelConfig(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=None if kv_heads == heads else kv_heads,
            intermediate_size=config["intermediate_size"],
            max_seq_len=config["max_position_embeddings"],
            rope_theta=rope.get("rope_theta", config.get("rope_theta", 10000.0)),
            norm_eps=config["rms_norm_eps"],
            tie_embeddings=config.get("tie_word_embeddings", False),
            init_std=config.get("initializer_range", 0.02),
        )
    except KeyError as error:
        raise DataError(f"{origin}: no {error.args[0]!r}") from None
    except ValueError as error:  # pydantic's ValidationError is one
        raise DataError(f"{origin}: {error}") from None


# ------------------------------------------------------------------------------------------------ the two sources


class PretrainedSource(ModelSource):
    """What both kinds of folder source share: the config, the digest of the weights, where they are."""

    backend: str

    def __init__(
        self,
        config: dict[str, Any],
        digest: str,
        folder: Path | None,
        tokenizer_config: dict[str, Any] | None = None,
    ) -> None:
        self.config = config
        self.digest = digest
        self.folder = folder
        self.tokenizer_config = tokenizer_config
        self._read_shape()

    def _read_shape(self) -> None:
        """Set vocab_size and max_seq_len (and what the backend needs) from the config; DataError if it cannot."""
        raise NotImplementedError

    @property
    def name(self) -> str:
        architectures = self.config.get("architectures") or [self.config["model_type"]]
        return str(architectures[0])

    def identity(self) -> dict[str, Any]:
        return {"backend": self.backend, "architecture": identity_config(self.config), "weights": self.digest}

    def start_summary(self) -> dict[str, str]:
        return {
            "model": self.name,
            "config": hashlib.sha256(json.dumps(identity_config(self.config), sort_keys=True).encode()).hexdigest()[
                :16
            ],
            "weights": self.digest[:16],
        }

    def record(self) -> dict[str, Any]:
        return {
            "kind": self.backend,
            "config": self.config,
            "weights": self.digest,
            "folder": str(self.folder) if self.folder else None,
            "tokenizer_config": self.tokenizer_config,
        }

    def export_config(self, tokenizer: Tokenizer, dtype: str) -> dict[str, Any]:
        """The source's own config.json, with the dtype the weights are written in."""
        written = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype]
        # transformers 4.x reads torch_dtype, 5.x writes dtype: both say what the file holds
        return {**self.config, "torch_dtype": written, **({"dtype": written} if "dtype" in self.config else {})}

    def _files(self) -> list[Path]:
        if self.folder is None or not self.folder.is_dir():
            raise DataError(f"the model folder {str(self.folder)!r} this run started from is not on this machine")
        return weight_files(self.folder)


class PretrainedDecoder(PretrainedSource, DecoderSource):
    """A Llama folder in this project's own decoder: the weights under the decoder's names (``model.`` dropped)."""

    backend = "pretrained-decoder"

    def _read_shape(self) -> None:
        DecoderSource.__init__(self, decoder_config(self.config, str(self.folder or "the model")))

    def own_name(self, hf_name: str) -> str:
        return hf_name.removeprefix("model.")

    def initial_model(self, device: torch.device) -> CausalLM:
        model = empty_decoder(self.model_config, torch.device("cpu"))
        params = dict(model.named_parameters())  # tied: lm_head.weight and embed_tokens.weight are one tensor
        origin = str(self.folder)
        with StoredWeights(self._files()) as stored:
            wanted = {self.own_name(n): n for n in stored.names() if not _is_derived(n)}
            if self.model_config.tie_embeddings:
                wanted.pop("lm_head.weight", None)  # a tied model saved with both copies
            distinct = {name for name, _ in self.layout()}
            missing, unexpected = sorted(distinct - set(wanted)), sorted(set(wanted) - distinct)
            if missing or unexpected:
                raise DataError(f"{origin}: missing weights {missing[:5]}, unexpected weights {unexpected[:5]}")
            with torch.no_grad():
                for name in sorted(distinct):
                    tensor = stored.get(wanted[name])
                    if tuple(tensor.shape) != tuple(params[name].shape):
                        raise DataError(
                            f"{origin}: {wanted[name]} has shape {tuple(tensor.shape)}, "
                            f"the config says {tuple(params[name].shape)}"
                        )
                    params[name].copy_(tensor.to(torch.float32))
        return model.to(device)


class TransformersCausalLM(CausalLM):
    """A ``transformers`` causal LM as the replica's model: token ids -> logits, like the decoder. Its parameters
    are the wrapped model's, under ``causal_lm.``."""

    def __init__(self, causal_lm: nn.Module, vocab_size: int, max_seq_len: int) -> None:
        super().__init__()
        self.causal_lm = causal_lm
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits, or with ``targets`` the mean loss of them (the decoder's contract, model/decoder.py)."""
        if tokens.shape[1] > self.max_seq_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_seq_len {self.max_seq_len}")
        logits: torch.Tensor = self.causal_lm(input_ids=tokens, use_cache=False).logits
        return logits if targets is None else token_loss(logits, targets)


PREFIX = "causal_lm."
_POSITION_FIELDS = ("max_position_embeddings", "n_positions", "n_ctx", "seq_length")


class TransformersModel(PretrainedSource):
    """Any causal LM ``transformers`` builds from its config, trained as ``transformers`` runs it."""

    backend = "transformers"

    def _read_shape(self) -> None:
        config = self.config
        positions = next((config[f] for f in _POSITION_FIELDS if isinstance(config.get(f), int)), None)
        if positions is None or not isinstance(config.get("vocab_size"), int):
            raise DataError(f"{str(self.folder)!r}: config.json gives no vocab_size or no maximum sequence length")
        self.vocab_size = int(config["vocab_size"])
        self.max_seq_len = int(positions)

    def _hf_config(self) -> Any:
        transformers = _transformers()
        fields = {k: v for k, v in self.config.items() if k != "model_type"}
        try:
            return transformers.AutoConfig.for_model(self.config["model_type"], **fields)
        except (ValueError, KeyError) as error:
            raise DataError(f"transformers {transformers.__version__} cannot build {self.name}: {error}") from None

    def _wrap(self, causal_lm: nn.Module) -> TransformersCausalLM:
        return TransformersCausalLM(causal_lm, self.vocab_size, self.max_seq_len)

    def skeleton(self) -> CausalLM:
        transformers = _transformers()
        with torch.device("meta"):
            return self._wrap(transformers.AutoModelForCausalLM.from_config(self._hf_config(), dtype=torch.float32))

    def initial_model(self, device: torch.device) -> CausalLM:
        transformers = _transformers()
        self._files()  # the error names a missing file before transformers' does
        causal_lm = transformers.AutoModelForCausalLM.from_pretrained(
            str(self.folder), dtype=torch.float32, local_files_only=True
        )
        return self._wrap(causal_lm).to(device)

    def with_weights(self, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> CausalLM:
        transformers = _transformers()
        model = self._wrap(transformers.AutoModelForCausalLM.from_config(self._hf_config(), dtype=torch.float32))
        copy_weights(model, names, tensors, origin=f"the {self.name} weights")
        return model

    def hf_name(self, name: str) -> str:
        return name.removeprefix(PREFIX)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise DataError("this model needs the transformers package: pip install 'transformers>=4.56'") from None
    transformers.logging.set_verbosity_error()  # its warnings about unused generation settings are noise here
    transformers.logging.disable_progress_bar()  # a node's log is line-oriented
    return transformers


def open_pretrained(folder: Path) -> PretrainedSource:
    """The source of ``--init-from FOLDER``: its config read, its weights found and digested (not loaded)."""
    folder = Path(folder).expanduser().resolve()
    if not folder.is_dir():
        raise DataError(f"--init-from {str(folder)!r}: no such folder")
    config = read_config(folder)
    digest = weights_digest(weight_files(folder))
    return _source(config, digest, folder, read_tokenizer_config(folder))


def _source(
    config: dict[str, Any], digest: str, folder: Path | None, tokenizer_config: dict[str, Any] | None
) -> PretrainedSource:
    try:
        return PretrainedDecoder(config, digest, folder, tokenizer_config)
    except DataError as why:
        if config.get("model_type") == "llama":
            log.info("%s; it trains through transformers", why)
        return TransformersModel(config, digest, folder, tokenizer_config)


def pretrained_from_record(record: dict[str, Any]) -> PretrainedSource:
    folder = Path(record["folder"]) if record.get("folder") else None
    cls = PretrainedDecoder if record["kind"] == PretrainedDecoder.backend else TransformersModel
    return cls(record["config"], str(record["weights"]), folder, record.get("tokenizer_config"))
