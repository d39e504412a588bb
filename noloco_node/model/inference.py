"""Using a trained model: its loss and perplexity on a dataset (``noloco-node eval``) and text sampled from it
(``noloco-node generate``).

Perplexity is exp(mean next-token cross-entropy in nats), over fixed, evenly spaced windows of the dataset's
validation split (data.validation_batches: the same windows the nodes evaluate on), so figures from ``eval``,
``/status`` and ``simulate`` are comparable when the data, tokenizer and sequence length are the same.

Sampling is plain autoregressive decoding over a window of the model's ``max_seq_len``, with temperature and
top-k; no KV cache, which is fine for the model sizes a CPU generates with and simple to trust.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from noloco_node.data.corpus import Corpus, validation_batches
from noloco_node.data.tokenizer import Tokenizer
from noloco_node.errors import DataError
from noloco_node.model.decoder import CausalLM, autocast_context


@dataclass
class EvalResult:
    loss: float
    tokens: int
    batches: int
    seconds: float
    split: str

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    def report(self) -> str:
        return (
            f"{self.split} loss {self.loss:.4f} nats/token, perplexity {self.perplexity:.3f} "
            f"({self.tokens:,} tokens in {self.batches} batches, {self.seconds:.1f} s)"
        )


def check_compatible(model: CausalLM, model_tokenizer: Tokenizer, corpus: Corpus, seq_len: int) -> None:
    """Refuse a dataset the model cannot read: other tokenizer, ids outside its vocabulary, windows too long."""
    cfg = model
    if corpus.tokenizer.fingerprint != model_tokenizer.fingerprint:
        raise DataError(
            f"the data is tokenized with {corpus.tokenizer.fingerprint}, the model was trained with "
            f"{model_tokenizer.fingerprint}: prepare the data with the model's tokenizer"
        )
    if corpus.vocab_size > cfg.vocab_size:
        raise DataError(f"the data's vocabulary ({corpus.vocab_size}) exceeds the model's ({cfg.vocab_size})")
    if seq_len > cfg.max_seq_len:
        raise DataError(f"seq_len {seq_len} exceeds the model's max_seq_len {cfg.max_seq_len}")


@torch.inference_mode()
def evaluate(
    model: CausalLM,
    corpus: Corpus,
    *,
    seq_len: int,
    batch_size: int,
    num_batches: int,
    split: str = "validation",
    device: torch.device | None = None,
) -> EvalResult:
    device = device or torch.device("cpu")
    tokens = corpus.validation if split == "validation" else corpus.train
    batches = validation_batches(tokens, seq_len=seq_len, batch_size=batch_size, num_batches=num_batches)
    model.eval().to(device)
    started = time.perf_counter()
    total, count = 0.0, 0
    for inputs, targets in batches:
        with autocast_context(device):
            loss = model.loss(inputs.to(device), targets.to(device))
        total += float(loss) * targets.numel()
        count += targets.numel()
    return EvalResult(total / count, count, len(batches), time.perf_counter() - started, split)


@torch.inference_mode()
def generate(
    model: CausalLM,
    tokenizer: Tokenizer,
    prompt: str,
    *,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int = 0,
    stop_at_end_of_document: bool = True,
    device: torch.device | None = None,
) -> str:
    """The prompt's continuation (the new text only). temperature 0 is greedy decoding."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, not {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, not {top_k}")
    device = device or torch.device("cpu")
    model.eval().to(device)
    ids = [int(i) for i in np.asarray(tokenizer.encode(prompt)).reshape(-1)] or list(tokenizer.document_separator)
    if not ids:
        raise ValueError("an empty prompt needs a tokenizer with an end-of-document token to start from")
    generator = torch.Generator(device="cpu").manual_seed(seed)
    stop = (
        set(tokenizer.document_separator) if stop_at_end_of_document and getattr(tokenizer, "eos_id", None) else set()
    )
    new: list[int] = []
    window = model.max_seq_len
    for _ in range(max_new_tokens):
        context = torch.tensor([(ids + new)[-window:]], dtype=torch.long, device=device)
        with autocast_context(device):
            logits = model(context)[0, -1].float().cpu()
        if temperature == 0:
            choice = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.numel():
                threshold = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < threshold, float("-inf"))
            choice = int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))
        if choice in stop:
            break
        new.append(choice)
    return tokenizer.decode(new)
