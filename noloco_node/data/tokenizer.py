"""Text to token ids: the byte-level default, and Hugging Face ``tokenizers`` tokenizers from a local file.

A tokenizer here is anything with ``encode_batch``, ``decode``, ``vocab_size``, a ``document_separator`` (the ids
put between two documents when they are packed into one stream) and a ``fingerprint`` (what makes two tokenizers
the same one; it is part of a run's fingerprint, so nodes with different tokenizers never blend).

- ``ByteTokenizer``: UTF-8 bytes are the ids (vocabulary 256); nothing to load, every text encodable.
- ``HFTokenizer``: a ``tokenizer.json`` written by the ``tokenizers`` library (or by ``transformers``' fast
  tokenizers), loaded from a path: nothing is fetched from the hub at run time.
- ``train_bpe_tokenizer``: a byte-level BPE trained on local documents, for runs that have no tokenizer yet.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from noloco_node.errors import DataError

# Special tokens that mark the end of a document, in the order they are looked for in a loaded tokenizer.
END_OF_DOCUMENT_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "[EOS]", "<|end_of_text|>")


class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...

    @property
    def fingerprint(self) -> str: ...

    @property
    def json_text(self) -> str | None:
        """The tokenizer.json content, to copy next to a prepared corpus or an exported model."""

    @property
    def document_separator(self) -> list[int]: ...

    def encode(self, text: str) -> np.ndarray: ...

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...

    def decode(self, ids: Sequence[int] | np.ndarray | torch.Tensor) -> str: ...


def _as_list(ids: Sequence[int] | np.ndarray | torch.Tensor) -> list[int]:
    if isinstance(ids, torch.Tensor):
        return [int(i) for i in ids.reshape(-1).tolist()]
    return [int(i) for i in np.asarray(ids).reshape(-1)]


class ByteTokenizer:
    """UTF-8 bytes are the tokens: a vocabulary of 256; documents are separated by a newline."""

    vocab_size = 256
    fingerprint = "bytes"
    json_text: str | None = None

    @property
    def document_separator(self) -> list[int]:
        return [10]

    def encode(self, text: str | bytes) -> np.ndarray:
        raw = text.encode("utf-8") if isinstance(text, str) else text
        return np.frombuffer(raw, dtype=np.uint8).copy()

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: Sequence[int] | np.ndarray | torch.Tensor) -> str:
        return bytes(i for i in _as_list(ids) if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer from the content of a ``tokenizer.json``."""

    def __init__(self, json_text: str, *, origin: str) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        try:
            self._tokenizer = RustTokenizer.from_str(json_text)
        except Exception as error:  # the Rust side raises its own Exception type for a malformed file
            first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise DataError(f"{origin} is not a tokenizers tokenizer.json: {first_line}") from None
        self.json_text = json_text
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        if self.vocab_size < 2:
            raise DataError(f"{origin} has a vocabulary of {self.vocab_size}")
        # The file's canonical content, so that whitespace or key order do not make two copies differ.
        canonical = json.dumps(json.loads(json_text), sort_keys=True, separators=(",", ":"))
        self.fingerprint = "tokenizers:" + hashlib.sha256(canonical.encode()).hexdigest()[:16]
        self.eos_id = next(
            (i for i in (self._tokenizer.token_to_id(t) for t in END_OF_DOCUMENT_TOKENS) if i is not None), None
        )

    @classmethod
    def from_file(cls, path: Path) -> HFTokenizer:
        """Load ``path`` (a tokenizer.json, or a folder holding one)."""
        path = Path(path).expanduser()
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise DataError(f"tokenizer file {str(path)!r} does not exist (give the path of a tokenizer.json)")
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as error:
            raise DataError(f"cannot read tokenizer file {str(path)!r}: {error.strerror}") from error
        except UnicodeDecodeError:
            raise DataError(f"tokenizer file {str(path)!r} is not UTF-8 JSON") from None
        return cls(text, origin=f"tokenizer file {str(path)!r}")

    @property
    def document_separator(self) -> list[int]:
        return [self.eos_id] if self.eos_id is not None else []

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.uint32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encodings]

    def decode(self, ids: Sequence[int] | np.ndarray | torch.Tensor) -> str:
        return self._tokenizer.decode(_as_list(ids), skip_special_tokens=False)


def load_tokenizer(path: Path | None) -> Tokenizer:
    """The tokenizer at ``path`` (a tokenizer.json, or a folder holding one); the byte tokenizer for None."""
    return ByteTokenizer() if path is None else HFTokenizer.from_file(path)


def train_bpe_tokenizer(documents: Iterable[str], *, vocab_size: int, out: Path) -> HFTokenizer:
    """Train a byte-level BPE (GPT-2 style: every byte sequence encodable, decoding exact) and save it to ``out``.

    ``<|endoftext|>`` is its one special token; it separates documents when a corpus is packed.
    """
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 257 + 1:
        raise DataError(f"a byte-level BPE needs a vocabulary above 257 (256 bytes + <|endoftext|>), not {vocab_size}")
    tokenizer = RustTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out))
    return HFTokenizer.from_file(out)
