"""Data in: tokenizers, documents from txt/jsonl/parquet, prepared token shards, the corpus and its shards."""
