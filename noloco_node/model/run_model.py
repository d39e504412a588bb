"""What a run's settings name: its corpus (tokenized with ``data.tokenizer`` or the tokenizer of ``--init-from``'s
folder) and its model source (a seeded decoder at a named size, or a pretrained folder: model/pretrained.py), and
the source a checkpoint or an export records. The one way every command derives them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from noloco_node.config.models import DataConfig, ModelConfig, TrainConfig, model_config_for
from noloco_node.data.corpus import Corpus, load_corpus
from noloco_node.data.tokenizer import Tokenizer, load_tokenizer
from noloco_node.errors import DataError
from noloco_node.model.pretrained import open_pretrained, pretrained_from_record
from noloco_node.model.source import ModelSource, SeededDecoder


def source_from_record(record: dict[str, Any]) -> ModelSource:
    """The source a checkpoint or an export was made from (the inverse of :meth:`ModelSource.record`)."""
    kind = record.get("kind")
    if kind == "seeded":
        return SeededDecoder(ModelConfig(**record["model_config"]), int(record["seed"]), str(record.get("size")))
    if kind in ("pretrained-decoder", "transformers"):
        return pretrained_from_record(record)
    raise DataError(f"unknown model source {kind!r}")


def model_source(train_cfg: TrainConfig, vocab_size: int) -> ModelSource:
    """The model a run of these settings trains on data of ``vocab_size`` token ids: a named size from the seed, or
    ``--init-from``'s folder."""
    if train_cfg.init_from is None:
        cfg = model_config_for(train_cfg.model_size, vocab_size=vocab_size, max_seq_len=train_cfg.seq_len)
        return SeededDecoder(cfg, train_cfg.seed, train_cfg.model_size)
    source = open_pretrained(train_cfg.init_from)
    if vocab_size > source.vocab_size:
        raise DataError(
            f"the data has {vocab_size} token ids, the model in {str(train_cfg.init_from)!r} embeds "
            f"{source.vocab_size}: use the model's own tokenizer (leave data.tokenizer unset)"
        )
    if train_cfg.seq_len > source.max_seq_len:
        raise DataError(
            f"train.seq_len ({train_cfg.seq_len}) exceeds what the model in {str(train_cfg.init_from)!r} takes "
            f"({source.max_seq_len} positions)"
        )
    return source


def run_tokenizer(data_cfg: DataConfig, train_cfg: TrainConfig) -> Tokenizer:
    """The run's tokenizer: ``data.tokenizer``, else the one of ``--init-from``'s folder, else bytes."""
    if train_cfg.init_from is not None and data_cfg.tokenizer is None:
        folder = train_cfg.init_from.expanduser()
        if not folder.is_dir():
            raise DataError(f"--init-from {str(folder)!r}: no such folder")
        if (folder / "tokenizer.json").is_file():
            return load_tokenizer(folder / "tokenizer.json")
        if not _exported_with_bytes(folder):  # a byte-level run's export has no tokenizer file: bytes need none
            raise DataError(
                f"{str(folder)!r} has no tokenizer.json: give the model's tokenizer with data.tokenizer (--tokenizer)"
            )
    return load_tokenizer(data_cfg.tokenizer)


def load_run_corpus(data_cfg: DataConfig, train_cfg: TrainConfig) -> Corpus:
    """The run's corpus, tokenized with the run's tokenizer (:func:`run_tokenizer`)."""
    if train_cfg.init_from is not None and data_cfg.tokenizer is None:
        return load_corpus(data_cfg, tokenizer=run_tokenizer(data_cfg, train_cfg))
    return load_corpus(data_cfg)


def _exported_with_bytes(folder: Path) -> bool:
    try:
        return json.loads((folder / "noloco.json").read_text()).get("tokenizer") == "bytes"
    except (OSError, ValueError, AttributeError):
        return False


def run_model(data_cfg: DataConfig, train_cfg: TrainConfig) -> tuple[Corpus, ModelSource]:
    """The corpus and the model of a run, the one way every command derives them from its settings."""
    corpus = load_run_corpus(data_cfg, train_cfg)
    return corpus, model_source(train_cfg, corpus.vocab_size)
