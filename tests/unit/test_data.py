"""Tokenizer, corpora and shards: splits by file, disjoint seeded shards, resumable positions, clear errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from noloco_node.config.models import DataConfig
from noloco_node.data.corpus import (
    ByteTokenizer,
    DataError,
    ReplicaShard,
    load_corpus,
    stdlib_source_files,
    validation_batches,
)


def test_byte_tokenizer_round_trips_any_text() -> None:
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'héllo ✓'\n"
    ids = tok.encode(text)
    assert ids.dtype == np.uint8 and len(ids) == len(text.encode())
    assert tok.decode(ids) == text


def test_stdlib_corpus_is_the_interpreters_library_split_by_file() -> None:
    corpus = load_corpus(DataConfig(max_bytes=2 * 2**20))
    assert corpus.vocab_size == 256
    assert 1.5 * 2**20 < len(corpus.train) + len(corpus.validation) < 2.5 * 2**20
    assert 0.01 < len(corpus.validation) / len(corpus.train) < 0.2
    text = bytes(np.asarray(corpus.train[:200000])).decode("utf-8", errors="replace")
    assert "def " in text and "import " in text
    root, files = stdlib_source_files()
    assert not any("site-packages" in str(f) or "/test/" in str(f.relative_to(root.parent)) for f in files)
    again = load_corpus(DataConfig(max_bytes=2 * 2**20))  # from the cache now
    assert "cached" in again.description
    assert np.array_equal(again.train, corpus.train) and np.array_equal(again.validation, corpus.validation)


def _write_folder(folder: Path, count: int) -> dict[str, bytes]:
    contents = {}
    for i in range(count):
        body = (f"# file {i}\n" + f"value_{i} = {i}\n" * 400).encode()
        (folder / f"f{i:03d}.py").write_bytes(body)
        contents[f"f{i:03d}.py"] = body
    return contents


def test_text_folder_split_is_by_whole_file(tmp_path: Path) -> None:
    contents = _write_folder(tmp_path, 60)
    corpus = load_corpus(DataConfig(source=str(tmp_path), validation_fraction=0.1))
    train, validation = bytes(np.asarray(corpus.train)), bytes(np.asarray(corpus.validation))
    in_validation = 0
    for body in contents.values():
        in_train, in_val = body in train, body in validation
        assert in_train != in_val  # every file lies wholly on one side
        in_validation += in_val
    assert 1 <= in_validation <= 20


def test_single_text_file_splits_by_position(tmp_path: Path) -> None:
    path = tmp_path / "book.txt"
    path.write_text("the quick brown fox jumps over the lazy dog\n" * 500)
    corpus = load_corpus(DataConfig(source=str(path), validation_fraction=0.1, cache_dir=tmp_path / "cache"))
    # One document cannot be split by document: validation is the tail of the stream (text + a separator).
    stream = path.read_bytes() + b"\n"
    assert len(corpus.validation) == pytest.approx(0.1 * len(stream), abs=2)
    assert bytes(np.asarray(corpus.train)) + bytes(np.asarray(corpus.validation)) == stream


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_files_are_memory_mapped(tmp_path: Path, dtype: str) -> None:
    tokens = (np.arange(100_000) % 5000).astype(dtype)
    np.save(tmp_path / "tokens.npy", tokens)
    tokens.tofile(tmp_path / "tokens.bin")
    from_npy = load_corpus(DataConfig(source=str(tmp_path / "tokens.npy")))
    from_bin = load_corpus(DataConfig(source=str(tmp_path / "tokens.bin"), token_dtype=dtype))
    for corpus in (from_npy, from_bin):
        assert isinstance(corpus.train.base, np.memmap) or isinstance(corpus.train, np.memmap)
        assert corpus.vocab_size == 5000
        assert np.array_equal(np.concatenate([corpus.train, corpus.validation]), tokens)


def test_token_file_errors_name_the_file(tmp_path: Path) -> None:
    raw = tmp_path / "tokens.bin"
    np.arange(1000, dtype=np.uint16).tofile(raw)
    with pytest.raises(DataError, match=r"tokens\.bin.*token_dtype"):
        load_corpus(DataConfig(source=str(raw)))
    with pytest.raises(DataError, match=r"token id 999, outside data.vocab_size 500"):
        load_corpus(DataConfig(source=str(raw), token_dtype="uint16", vocab_size=500))
    np.save(tmp_path / "floats.npy", np.zeros(10, dtype=np.float32))
    with pytest.raises(DataError, match=r"floats\.npy.*uint16/uint32"):
        load_corpus(DataConfig(source=str(tmp_path / "floats.npy")))


def test_missing_and_empty_sources_get_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"does-not-exist.*does not exist"):
        load_corpus(DataConfig(source=str(tmp_path / "does-not-exist")))
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(DataError, match=r"empty\.txt.*is empty"):
        load_corpus(DataConfig(source=str(tmp_path / "empty.txt")))
    empty_dir = tmp_path / "nothing"
    empty_dir.mkdir()
    with pytest.raises(DataError, match=r"contains no text, \.jsonl or \.parquet files"):
        load_corpus(DataConfig(source=str(empty_dir)))


def test_shards_are_disjoint_balanced_and_seeded() -> None:
    tokens = np.arange(400_000, dtype=np.uint32)
    shards = [ReplicaShard(tokens, replica=r, num_replicas=4, seq_len=64, seed=1) for r in range(4)]
    blocks = [set(s.block_starts.tolist()) for s in shards]
    for i in range(4):
        for j in range(i + 1, 4):
            assert not blocks[i] & blocks[j]
    sizes = [len(b) for b in blocks]
    assert max(sizes) - min(sizes) <= 1
    other_seed = ReplicaShard(tokens, replica=0, num_replicas=4, seq_len=64, seed=2)
    assert set(other_seed.block_starts.tolist()) != blocks[0]
    # Every window a replica reads lies inside its own blocks.
    inputs, targets = shards[2].next_batch(32)
    block = shards[2].block_starts[1] - shards[2].block_starts[0] if len(blocks[2]) > 1 else 8192
    for row in inputs[:, 0].tolist():
        assert any(start <= row < start + 8192 for start in blocks[2]), (row, block)
    assert np.array_equal(targets[:, :-1].numpy(), inputs[:, 1:].numpy())


def test_shard_position_resumes_the_stream_exactly_across_epochs() -> None:
    tokens = np.arange(60_000, dtype=np.uint32)
    shard = ReplicaShard(tokens, replica=0, num_replicas=2, seq_len=64, seed=0)
    assert shard.num_windows < 40 * 16  # so that 40 batches of 16 cross an epoch boundary
    for _ in range(25):
        shard.next_batch(16)
    saved = shard.position
    expected = [shard.next_batch(16)[0] for _ in range(15)]
    resumed = ReplicaShard(tokens, replica=0, num_replicas=2, seq_len=64, seed=0)
    resumed.seek(saved)
    got = [resumed.next_batch(16)[0] for _ in range(15)]
    assert shard.epoch >= 1
    for a, b in zip(expected, got, strict=True):
        assert np.array_equal(a.numpy(), b.numpy())


def test_too_many_replicas_for_the_corpus_is_an_error() -> None:
    with pytest.raises(DataError, match="fewer than the 8 replicas"):
        ReplicaShard(np.zeros(20_000, dtype=np.uint8), replica=0, num_replicas=8, seq_len=64, seed=0)


def test_validation_batches_are_fixed_and_full() -> None:
    tokens = np.arange(10_000, dtype=np.uint32)
    a = validation_batches(tokens, seq_len=32, batch_size=4, num_batches=3)
    b = validation_batches(tokens, seq_len=32, batch_size=4, num_batches=3)
    assert len(a) == 3 and all(x.shape == (4, 32) for x, _ in a)
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert np.array_equal(xa.numpy(), xb.numpy()) and np.array_equal(ya.numpy(), yb.numpy())
