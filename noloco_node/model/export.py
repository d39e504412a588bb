"""A usable model out of a run: ``safetensors`` weights plus configs that this package's ``LlamaDecoder`` and
``transformers``' ``LlamaForCausalLM`` both load, and the loader that ``eval`` and ``generate`` use.

NoLoCo never makes the replicas identical (arXiv 2506.10911: eq. 3-5 pull each *pair* towards its mean; only the
learning-rate decay shrinks the spread of the whole swarm), so "the trained model" is a choice:

- ``--from self``: one node's replica from its checkpoint: its slow weights phi (default; what it blends and what
  a joiner downloads), or its fast weights theta (``--weights fast``, the model its last inner step trained);
- ``--from swarm --peers K``: the equal-weight average of K live peers' slow weights (consensus.py).

An exported folder::

    model.safetensors       weights under Hugging Face Llama names (model.layers.0.self_attn.q_proj.weight, ...)
    config.json             a LlamaConfig (architectures: LlamaForCausalLM); transformers' from_pretrained reads it
    noloco.json             this package's ModelConfig and where the weights came from (peers, steps, spread)
    tokenizer.json          when the run used a tokenizers tokenizer, with a tokenizer_config.json for AutoTokenizer

The model maps one to one: RMSNorm, rotate-half RoPE, SwiGLU and (un)tied embeddings are Llama's, so only the
names gain a ``model.`` prefix (``lm_head.weight`` keeps its name and is left out when tied).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from noloco_node.config.models import ModelConfig
from noloco_node.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from noloco_node.errors import DataError
from noloco_node.model.decoder import LlamaDecoder, named_parameters_ordered

EXPORT_FORMAT = 1
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def hf_name(name: str) -> str:
    """This package's parameter name -> the one LlamaForCausalLM uses."""
    return name if name.startswith("lm_head.") else f"model.{name}"


def own_name(name: str) -> str:
    return name.removeprefix("model.")


def llama_config(cfg: ModelConfig, tokenizer: Tokenizer, dtype: str = "fp32") -> dict[str, Any]:
    """The config.json of a LlamaForCausalLM with exactly this model's shape (no grouped-query attention)."""
    eos = getattr(tokenizer, "eos_id", None)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_heads,
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


def model_config_from_llama(config: dict[str, Any], origin: str) -> ModelConfig:
    """Read a plain Hugging Face Llama config.json back, refusing what LlamaDecoder cannot represent."""
    heads = config.get("num_attention_heads")
    unsupported = []
    if config.get("num_key_value_heads", heads) != heads:
        unsupported.append("grouped-query attention (num_key_value_heads != num_attention_heads)")
    if config.get("attention_bias") or config.get("mlp_bias"):
        unsupported.append("biases")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        unsupported.append(f"rope scaling {rope.get('rope_type', rope.get('type'))!r}")
    if unsupported:
        raise DataError(f"{origin}: this Llama uses {', '.join(unsupported)}, which LlamaDecoder does not model")
    try:
        return ModelConfig(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            intermediate_size=config["intermediate_size"],
            max_seq_len=config["max_position_embeddings"],
            rope_theta=rope.get("rope_theta", config.get("rope_theta", 10000.0)),
            norm_eps=config["rms_norm_eps"],
            tie_embeddings=config.get("tie_word_embeddings", False),
            init_std=config.get("initializer_range", 0.02),
        )
    except KeyError as error:
        raise DataError(f"{origin}: no {error.args[0]!r}") from None


@dataclass
class ExportedWeights:
    """Weights in this package's names and order, with what is needed to use them."""

    model_config: ModelConfig
    names: list[str]
    tensors: list[torch.Tensor]
    tokenizer: Tokenizer
    provenance: dict[str, Any] = field(default_factory=dict)

    def model(self) -> LlamaDecoder:
        model = LlamaDecoder(self.model_config)
        load_weights(model, self.names, self.tensors, origin=self.provenance.get("source", "the weights"))
        return model


@torch.no_grad()
def load_weights(model: LlamaDecoder, names: Sequence[str], tensors: Sequence[torch.Tensor], *, origin: str) -> None:
    """Copy named tensors into ``model``; every name and shape is checked before anything is copied."""
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


def write_export(out: Path, weights: ExportedWeights, *, dtype: str = "fp32") -> None:
    """Write an exported folder at ``out`` (written under a temporary name, then renamed: never half a model)."""
    from safetensors.torch import save_file

    out = Path(out)
    if out.exists():
        raise DataError(f"{str(out)!r} exists; remove it or choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=out.name + ".partial.", dir=out.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the result is read by other users (nodes, containers)
    try:
        cast = DTYPES[dtype]
        tensors = {
            hf_name(name): tensor.detach().to("cpu", cast).contiguous()
            for name, tensor in zip(weights.names, weights.tensors, strict=True)
        }
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        config = llama_config(weights.model_config, weights.tokenizer, dtype)
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        noloco = {
            "format": EXPORT_FORMAT,
            "model_config": weights.model_config.model_dump(mode="json"),
            "tokenizer": weights.tokenizer.fingerprint,
            "dtype": dtype,
            **weights.provenance,
        }
        (staging / "noloco.json").write_text(json.dumps(noloco, indent=2))
        if weights.tokenizer.json_text is not None:
            (staging / "tokenizer.json").write_text(weights.tokenizer.json_text, encoding="utf-8")
            eos = getattr(weights.tokenizer, "eos_id", None)
            tokenizer_config: dict[str, Any] = {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": config["max_position_embeddings"],
            }
            if eos is not None:
                tokenizer_config["eos_token"] = weights.tokenizer.decode([eos])
            (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def checkpoint_weights(path: Path, *, weights: str = "slow") -> ExportedWeights:
    """One replica's weights from a node's or ``train``'s checkpoint.pt (or the folder holding one)."""
    from noloco_node.training.checkpoints import load_checkpoint

    path = Path(path).expanduser()
    if path.is_dir():
        path = path / "checkpoint.pt"
    try:
        payload = load_checkpoint(path)
    except FileNotFoundError:
        raise DataError(f"no checkpoint at {str(path)!r}") from None
    except (ValueError, RuntimeError, OSError) as error:
        raise DataError(f"cannot read checkpoint {str(path)!r}: {error}") from None
    if weights not in ("slow", "fast"):
        raise DataError(f"weights must be 'slow' (phi) or 'fast' (theta), not {weights!r}")
    replica = payload["replica"]
    tokenizer_json = payload.get("tokenizer_json")
    tokenizer = HFTokenizer(tokenizer_json, origin=f"the tokenizer in {path}") if tokenizer_json else ByteTokenizer()
    return ExportedWeights(
        ModelConfig(**payload["model_config"]),
        list(replica["param_names"]),
        list(replica["phi" if weights == "slow" else "theta"]),
        tokenizer,
        {
            "source": f"checkpoint {path}",
            "weights": "phi (slow)" if weights == "slow" else "theta (fast)",
            "run_fingerprint": payload.get("run_fingerprint"),
            "outer_step": replica["outer_step"],
            "inner_step": replica["inner_step"],
        },
    )


def exported_weights(folder: Path) -> ExportedWeights:
    """An exported folder (or any plain Hugging Face Llama folder with model.safetensors and config.json)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder).expanduser()
    weights_path, config_path = folder / "model.safetensors", folder / "config.json"
    for needed in (weights_path, config_path):
        if not needed.is_file():
            raise DataError(f"{str(folder)!r} is not an exported model: no {needed.name}")
    try:
        noloco = json.loads((folder / "noloco.json").read_text()) if (folder / "noloco.json").is_file() else {}
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise DataError(f"cannot read the configs in {str(folder)!r}: {error}") from None
    if "model_config" in noloco:
        model_config = ModelConfig(**noloco["model_config"])
    else:
        model_config = model_config_from_llama(config, str(config_path))
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError) as error:
        raise DataError(f"cannot read {str(weights_path)!r}: {error}") from None
    names = [own_name(n) for n in tensors]
    tokenizer_path = folder / "tokenizer.json"
    tokenizer: Tokenizer = HFTokenizer.from_file(tokenizer_path) if tokenizer_path.is_file() else ByteTokenizer()
    values = list(tensors.values())
    if model_config.tie_embeddings and "lm_head.weight" in names:  # a tied model saved with both copies
        keep = [i for i, n in enumerate(names) if n != "lm_head.weight"]
        names, values = [names[i] for i in keep], [values[i] for i in keep]
    return ExportedWeights(model_config, names, values, tokenizer, {**noloco, "source": str(folder)})


def load_any(path: Path, *, weights: str = "slow") -> ExportedWeights:
    """An exported folder, a checkpoint file, or a folder holding checkpoint.pt (a node's --data-dir)."""
    path = Path(path).expanduser()
    if path.is_dir() and (path / "model.safetensors").is_file():
        return exported_weights(path)
    if path.is_file() or (path.is_dir() and (path / "checkpoint.pt").is_file()):
        return checkpoint_weights(path, weights=weights)
    raise DataError(f"{str(path)!r} is neither an exported model (model.safetensors) nor a checkpoint (checkpoint.pt)")
