"""Tiny random Hugging Face causal LMs saved as a user's folder would be (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json): the inputs of ``--init-from`` in the tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from noloco_node.data.tokenizer import HFTokenizer, train_bpe_tokenizer

ARCHITECTURES = ("llama", "qwen2", "gpt2")
TEXT = "".join(f"def function_{i}(x):\n    return x * {i} + {i % 7}  # line {i}\n" for i in range(4000))


def tokenizer_file(folder: Path, vocab_size: int = 320) -> HFTokenizer:
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = train_bpe_tokenizer([TEXT[i : i + 2000] for i in range(0, len(TEXT), 2000)], vocab_size=vocab_size,
                                    out=folder / "tokenizer.json")  # fmt: skip
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "model_max_length": 128}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return tokenizer


def save_model(kind: str, folder: Path, *, seed: int = 0, vocab_size: int = 320) -> Path:
    """A random model of ``kind`` (llama: grouped-query attention, untied; qwen2: tied, with biases; gpt2: learned
    positions, LayerNorm) with its tokenizer, saved with save_pretrained into ``folder``."""
    import transformers

    tokenizer_file(folder, vocab_size)
    common = {"vocab_size": vocab_size, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    if kind == "llama":
        config = transformers.LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                          tie_word_embeddings=False, **common)  # fmt: skip
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen2":
        config = transformers.Qwen2Config(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                          tie_word_embeddings=True, **common)  # fmt: skip
        cls = transformers.Qwen2ForCausalLM
    elif kind == "gpt2":
        config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128, **common)
        cls = transformers.GPT2LMHeadModel
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = cls(config)
    with torch.no_grad():  # norms off 1.0, so that a mix-up of any tensor shows in the logits
        for name, param in model.named_parameters():
            if "norm" in name or "ln_" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    return folder
