"""Tokenized corpora on disk: written once (``noloco-node data prepare``), memory-mapped by every node.

A prepared folder holds::

    meta.json                     format, dtype, vocabulary, tokenizer fingerprint, token and document counts
    tokenizer.json                a copy of the tokenizer (absent for the byte-level tokenizer)
    train-00000.bin ...           raw token ids in meta's dtype, at most ``shard_tokens`` per file
    validation-00000.bin ...

Documents stream in from documents.py, are tokenized a batch at a time and appended to the shard files, each
followed by the tokenizer's document separator: memory holds one batch (a few MiB of text), whatever the corpus
size. A document goes to validation when a hash of its first piece falls under ``validation_fraction``, so the
split depends on the text alone (the same documents as .txt, .jsonl or .parquet give the same two streams). When
that leaves the validation split short (a corpus of a few large documents), the tail of the training stream is
moved over. The folder is written under a temporary name and renamed into place: readers never see half of it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from noloco_node.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from noloco_node.errors import DataError

PREPARED_FORMAT = 1
DEFAULT_SHARD_TOKENS = 2**28  # 512 MiB of uint16 ids per shard file
BATCH_CHARACTERS = 4 * 2**20  # text tokenized per encode_batch call
COPY_TOKENS = 2**24


def token_dtype_for(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id of the vocabulary."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype)
    raise DataError(f"a vocabulary of {vocab_size} does not fit in uint32 token ids")


class TokenShards:
    """Several memory-mapped token files seen as one 1-D stream (length and slicing, which is all sharding needs)."""

    ndim = 1

    def __init__(self, parts: list[np.ndarray]) -> None:
        self.parts = [p for p in parts if len(p)]
        self.ends = np.cumsum([len(p) for p in self.parts]) if self.parts else np.zeros(0, dtype=np.int64)
        self.dtype = parts[0].dtype

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __getitem__(self, key: int | slice) -> np.ndarray | np.integer:
        if isinstance(key, (int, np.integer)):
            index = int(key) + (len(self) if key < 0 else 0)
            part = int(np.searchsorted(self.ends, index, side="right"))
            if not 0 <= index < len(self):
                raise IndexError(f"token {key} is outside a stream of {len(self)}")
            return self.parts[part][index - (int(self.ends[part - 1]) if part else 0)]
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise IndexError("token streams are sliced with step 1 only")
        pieces = []
        while start < stop:
            part = int(np.searchsorted(self.ends, start, side="right"))
            offset = int(self.ends[part - 1]) if part else 0
            take = min(stop, int(self.ends[part])) - start
            pieces.append(np.asarray(self.parts[part][start - offset : start - offset + take]))
            start += take
        return np.concatenate(pieces) if len(pieces) != 1 else pieces[0]


class _ShardWriter:
    """Appends token ids to ``<split>-NNNNN.bin`` files of at most ``shard_tokens`` ids each."""

    def __init__(self, folder: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.folder, self.split, self.dtype, self.shard_tokens = folder, split, dtype, shard_tokens
        self.files: list[list] = []  # [name, tokens]
        self.tokens = 0
        self.documents = 0
        self._handle: BinaryIO | None = None

    def write(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids).astype(self.dtype, copy=False)
        while len(ids):
            if self._handle is None or self.files[-1][1] == self.shard_tokens:
                self._open_next()
            room = self.shard_tokens - self.files[-1][1]
            head, ids = ids[:room], ids[room:]
            assert self._handle is not None  # opened just above
            self._handle.write(head.tobytes())
            self.files[-1][1] += len(head)
            self.tokens += len(head)

    def _open_next(self) -> None:
        if self._handle is not None:
            self._handle.close()
        name = f"{self.split}-{len(self.files):05d}.bin"
        self._handle = (self.folder / name).open("wb")
        self.files.append([name, 0])

    def close(self) -> None:
        if self._handle is not None:
            self._handle.flush()
            os.fsync(self._handle.fileno())
            self._handle.close()
            self._handle = None


@dataclass
class PrepareSummary:
    out: Path
    files: int
    documents: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    text_bytes: int = 0
    moved_tail_tokens: int = 0
    seconds: float = 0.0

    def report(self) -> str:
        total = sum(self.tokens.values())
        rate = self.text_bytes / max(self.seconds, 1e-9) / 2**20
        lines = [
            f"prepared {self.out}: {self.files} files, {sum(self.documents.values()):,} documents, "
            f"{self.text_bytes / 2**20:,.1f} MiB of text in {self.seconds:.1f} s ({rate:.1f} MiB/s)",
            f"  train:      {self.tokens['train']:>14,} tokens  {self.documents['train']:>10,} documents",
            f"  validation: {self.tokens['validation']:>14,} tokens  {self.documents['validation']:>10,} documents"
            + (f" (incl. {self.moved_tail_tokens:,} tokens of the training tail)" if self.moved_tail_tokens else ""),
            f"  bytes of text per token: {self.text_bytes / max(total, 1):.2f}",
        ]
        return "\n".join(lines)


def _goes_to_validation(first_piece: str, fraction: float) -> bool:
    digest = hashlib.sha256(b"validation:" + first_piece.encode("utf-8", errors="replace")).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


def prepare_corpus(
    pieces: Iterable[tuple[bool, str]],
    out: Path,
    tokenizer: Tokenizer,
    *,
    files: int,
    description: str,
    validation_fraction: float = 0.05,
    max_bytes: int | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    overwrite_race_ok: bool = False,
) -> PrepareSummary:
    """Tokenize ``pieces`` (documents.iter_documents) into a prepared folder at ``out``."""
    out = Path(out)
    if out.exists() and not overwrite_race_ok:
        raise DataError(f"{str(out)!r} exists; remove it or choose another --out")
    started = time.monotonic()
    dtype = token_dtype_for(tokenizer.vocab_size)
    separator = np.asarray(tokenizer.document_separator, dtype=np.int64)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=out.name + ".partial.", dir=out.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the result is read by other users (nodes, containers)
    summary = PrepareSummary(out, files)
    writers = {split: _ShardWriter(staging, split, dtype, shard_tokens) for split in ("train", "validation")}
    try:
        batch: list[tuple[str, str | None]] = []  # (split, text); None: the separator that closes a document
        batch_chars = 0
        split: str | None = None

        def flush() -> None:
            nonlocal batch_chars
            texts = [text for _, text in batch if text is not None]
            encoded = iter(tokenizer.encode_batch(texts) if texts else [])
            for where, text in batch:
                writers[where].write(separator if text is None else next(encoded))
            batch.clear()
            batch_chars = 0

        for starts_document, text in pieces:
            if max_bytes is not None and summary.text_bytes >= max_bytes:
                break
            if starts_document or split is None:
                if split is not None:
                    batch.append((split, None))
                split = "validation" if _goes_to_validation(text, validation_fraction) else "train"
                writers[split].documents += 1
            batch.append((split, text))
            summary.text_bytes += len(text.encode("utf-8", errors="replace"))
            batch_chars += len(text)
            if batch_chars >= BATCH_CHARACTERS:
                flush()
        if split is None:
            raise DataError(f"{description}: no documents (every file is empty)")
        batch.append((split, None))
        flush()
        total = writers["train"].tokens + writers["validation"].tokens
        if total < 64:
            raise DataError(f"{description}: only {total} tokens, too few to train on")
        summary.moved_tail_tokens = _top_up_validation(writers, validation_fraction)
        for writer in writers.values():
            writer.close()
        summary.documents = {name: w.documents for name, w in writers.items()}
        summary.tokens = {name: w.tokens for name, w in writers.items()}
        meta = {
            "format": PREPARED_FORMAT,
            "dtype": dtype.name,
            "vocab_size": tokenizer.vocab_size,
            "tokenizer": {
                "fingerprint": tokenizer.fingerprint,
                "file": "tokenizer.json" if tokenizer.json_text else None,
            },
            "document_separator": [int(i) for i in separator],
            "source": description,
            "validation_fraction": validation_fraction,
            "splits": {
                name: {"files": [list(f) for f in w.files], "tokens": w.tokens, "documents": w.documents}
                for name, w in writers.items()
            },
            "text_bytes": summary.text_bytes,
        }
        if tokenizer.json_text is not None:
            (staging / "tokenizer.json").write_text(tokenizer.json_text, encoding="utf-8")
        (staging / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            staging.rename(out)
        except OSError:
            if not (overwrite_race_ok and out.exists()):
                raise
            shutil.rmtree(staging)  # another process prepared the same corpus first: its copy is as good
    except BaseException:
        for writer in writers.values():
            writer.close()
        shutil.rmtree(staging, ignore_errors=True)
        raise
    summary.seconds = time.monotonic() - started
    return summary


def _top_up_validation(writers: dict[str, _ShardWriter], fraction: float) -> int:
    """When hashing whole documents left validation under half its share, move the training tail over."""
    train, validation = writers["train"], writers["validation"]
    total = train.tokens + validation.tokens
    if validation.tokens >= 0.5 * fraction * total:
        return 0
    move = int(fraction * total) - validation.tokens
    train.close()
    start = train.tokens - move
    offset = 0
    for entry in list(train.files):
        name, count = entry
        path = train.folder / name
        lo, hi = max(start - offset, 0), count
        if lo < hi:
            stream = np.memmap(path, dtype=train.dtype, mode="r", shape=(count,))
            for at in range(lo, hi, COPY_TOKENS):
                validation.write(np.array(stream[at : min(hi, at + COPY_TOKENS)]))
            del stream
            if lo == 0:
                path.unlink()
                train.files.remove(entry)
            else:
                os.truncate(path, lo * train.dtype.itemsize)
                entry[1] = lo
        offset += count
    train.tokens -= move
    return move


@dataclass(frozen=True)
class PreparedCorpus:
    train: np.ndarray | TokenShards
    validation: np.ndarray | TokenShards
    tokenizer: Tokenizer
    vocab_size: int
    description: str
    fingerprint: str


def is_prepared(path: Path) -> bool:
    return path.is_dir() and (path / "meta.json").is_file()


def load_prepared(folder: Path) -> PreparedCorpus:
    """Memory-map a prepared folder; every file is checked against meta.json before anything is used."""
    meta_path = folder / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise DataError(f"cannot read {str(meta_path)!r}: {error}") from None
    if meta.get("format") != PREPARED_FORMAT:
        raise DataError(f"{str(meta_path)!r}: unknown prepared-corpus format {meta.get('format')!r}")
    dtype = np.dtype(meta["dtype"])
    tokenizer: Tokenizer
    if meta["tokenizer"]["file"]:
        tokenizer = HFTokenizer.from_file(folder / meta["tokenizer"]["file"])
        if tokenizer.fingerprint != meta["tokenizer"]["fingerprint"]:
            raise DataError(f"{folder / 'tokenizer.json'} is not the tokenizer this corpus was prepared with")
    else:
        tokenizer = ByteTokenizer()
    splits: dict[str, np.ndarray | TokenShards] = {}
    for split in ("train", "validation"):
        parts: list[np.ndarray] = []
        for name, count in meta["splits"][split]["files"]:
            path = folder / name
            size = path.stat().st_size if path.is_file() else -1
            if size != count * dtype.itemsize:
                raise DataError(
                    f"{str(path)!r} should hold {count} {dtype.name} tokens ({count * dtype.itemsize} bytes) but "
                    + ("is missing" if size < 0 else f"has {size} bytes")
                    + "; prepare the corpus again"
                )
            if count:
                parts.append(np.memmap(path, dtype=dtype, mode="r", shape=(count,)))
        if not parts:
            raise DataError(f"prepared corpus {str(folder)!r} has an empty {split} split")
        splits[split] = parts[0] if len(parts) == 1 else TokenShards(parts)
    material = json.dumps([meta["splits"], meta["tokenizer"]], sort_keys=True).encode()
    fingerprint = hashlib.sha256(material + np.asarray(splits["train"][:65536]).tobytes()).hexdigest()[:16]
    description = (
        f"prepared corpus {folder} ({meta['source']}; {meta['splits']['train']['tokens']:,} train / "
        f"{meta['splits']['validation']['tokens']:,} validation tokens)"
    )
    return PreparedCorpus(
        splits["train"], splits["validation"], tokenizer, int(meta["vocab_size"]), description, fingerprint
    )
