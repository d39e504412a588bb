"""A usable model out of a run: a Hugging Face folder that ``transformers`` loads (and ``--init-from`` reads back),
and the loader that ``eval`` and ``generate`` use.

NoLoCo never makes the replicas identical (arXiv 2506.10911: eq. 3-5 pull each *pair* towards its mean; only the
learning-rate decay shrinks the spread of the whole swarm), so "the trained model" is a choice:

- ``--from self``: one node's replica from its checkpoint: its slow weights phi (default; what it blends and what
  a joiner downloads), or its fast weights theta (``--weights fast``, the model its last inner step trained);
- ``--from swarm --peers K``: the equal-weight average of K live peers' slow weights (consensus.py).

An exported folder::

    model.safetensors       weights under the source architecture's own names (model.layers.0.self_attn.q_proj.weight)
    config.json             this project's decoder as a LlamaConfig; a run started with --init-from: the source's own
    noloco.json             the run's model source and where the weights came from (peers, steps, spread)
    tokenizer.json          when the run used a tokenizers tokenizer, with a tokenizer_config.json for AutoTokenizer

The decoder maps one to one onto LlamaForCausalLM: RMSNorm, rotate-half RoPE, SwiGLU, grouped-query attention and
(un)tied embeddings are Llama's, so only the names gain a ``model.`` prefix (``lm_head.weight`` keeps its name and
is left out when tied). A run started from another architecture writes it back in that architecture's layout
(model/source.py, ``ModelSource.hf_name`` and ``export_config``).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from noloco_node.config.models import ModelConfig
from noloco_node.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from noloco_node.errors import DataError
from noloco_node.model.checkpoint_file import load_checkpoint
from noloco_node.model.decoder import CausalLM, named_parameters_ordered
from noloco_node.model.pretrained import open_pretrained
from noloco_node.model.run_model import source_from_record
from noloco_node.model.source import ModelSource, SeededDecoder

EXPORT_FORMAT = 2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class ExportedWeights:
    """Weights in the run's parameter names and order, with the model source that gives them meaning."""

    source: ModelSource
    names: list[str]
    tensors: list[torch.Tensor]
    tokenizer: Tokenizer
    provenance: dict[str, Any] = field(default_factory=dict)
    built: CausalLM | None = None  # the model these tensors already live in, when they were read as one

    def model(self) -> CausalLM:
        if self.built is None:
            self.built = self.source.with_weights(self.names, self.tensors)
        return self.built


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
        source = weights.source
        tensors = {
            source.hf_name(name): tensor.detach().to("cpu", cast).contiguous()
            for name, tensor in zip(weights.names, weights.tensors, strict=True)
        }
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        config = source.export_config(weights.tokenizer, dtype)
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        noloco = {
            "format": EXPORT_FORMAT,
            "model_source": source.record(),
            "tokenizer": weights.tokenizer.fingerprint,
            "dtype": dtype,
            **weights.provenance,
        }
        (staging / "noloco.json").write_text(json.dumps(noloco, indent=2))
        if weights.tokenizer.json_text is not None:
            (staging / "tokenizer.json").write_text(weights.tokenizer.json_text, encoding="utf-8")
            tokenizer_config: dict[str, Any] | None = getattr(source, "tokenizer_config", None)
            if tokenizer_config is None:  # the source folder's own, when the run started from one
                eos = getattr(weights.tokenizer, "eos_id", None)
                tokenizer_config = {
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "model_max_length": source.max_seq_len,
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
    if "model_source" in payload:
        source = source_from_record(payload["model_source"])
    else:  # written before runs had model sources: always the seeded decoder
        source = SeededDecoder(ModelConfig(**payload["model_config"]), seed=0)
    return ExportedWeights(
        source,
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
    """An exported folder, or any Hugging Face causal LM folder ``--init-from`` reads (model/pretrained.py)."""
    folder = Path(folder).expanduser()
    try:
        noloco = json.loads((folder / "noloco.json").read_text()) if (folder / "noloco.json").is_file() else {}
    except (OSError, json.JSONDecodeError) as error:
        raise DataError(f"cannot read {str(folder / 'noloco.json')!r}: {error}") from None
    source = open_pretrained(folder)
    model = source.initial_model(torch.device("cpu"))
    names, tensors = zip(*((name, p.detach()) for name, p in named_parameters_ordered(model)), strict=True)
    tokenizer_path = folder / "tokenizer.json"
    tokenizer: Tokenizer = HFTokenizer.from_file(tokenizer_path) if tokenizer_path.is_file() else ByteTokenizer()
    provenance = {**noloco, "source": str(folder)}
    return ExportedWeights(source, list(names), list(tensors), tokenizer, provenance, built=model)


def load_any(path: Path, *, weights: str = "slow") -> ExportedWeights:
    """An exported folder, a checkpoint file, or a folder holding checkpoint.pt (a node's --data-dir)."""
    path = Path(path).expanduser()
    if path.is_dir() and (path / "model.safetensors").is_file():
        return exported_weights(path)
    if path.is_file() or (path.is_dir() and (path / "checkpoint.pt").is_file()):
        return checkpoint_weights(path, weights=weights)
    raise DataError(f"{str(path)!r} is neither an exported model (model.safetensors) nor a checkpoint (checkpoint.pt)")
