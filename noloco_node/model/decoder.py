"""A Llama-style decoder-only language model with named sizes.

The architecture is the one the NoLoCo paper trains (arXiv 2506.10911, section 4: Llama models of 125M, 1.3B and
6.8B parameters): pre-norm blocks with RMSNorm, rotary position embeddings (RoPE) on queries and keys, causal
multi-head attention and a SwiGLU feed-forward, tied or untied input/output embeddings.

RoPE uses the "rotate half" layout (as Hugging Face's ``LlamaForCausalLM`` does) so that the weight names and
layouts map one-to-one onto that class when a model is exported.

Named sizes: ``tiny`` and ``small`` train on a CPU in minutes; ``125m``, ``1.3b`` and ``6.8b`` are the paper's
shapes. The vocabulary size is not part of a named size: it comes from the tokenizer.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from noloco_node.config.models import ModelConfig
from noloco_node.model.chunked_loss import linear_cross_entropy


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (no mean subtraction, no bias), computed in fp32 for stability under bf16."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


def rotary_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (max_seq_len, head_dim) in the rotate-half layout."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, heads, seq, head_dim) queries or keys by their position."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Attention(nn.Module):
    """Causal self-attention; with fewer key/value heads than query heads (grouped-query attention, as in Llama 3),
    each key/value head serves ``num_heads / num_kv_heads`` query heads."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.kv_heads = cfg.kv_heads
        self.head_dim = cfg.head_dim
        kv_width = cfg.kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_width, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_width, bias=False)
        self.o_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape

        def heads(t: torch.Tensor, count: int) -> torch.Tensor:
            return t.view(batch, seq, count, self.head_dim).transpose(1, 2)

        q = apply_rotary(heads(self.q_proj(x), self.num_heads), cos, sin)
        k = apply_rotary(heads(self.k_proj(x), self.kv_heads), cos, sin)
        v = heads(self.v_proj(x), self.kv_heads)
        # Grouped-query attention reads each key/value head for its group of query heads: nothing is copied.
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.num_heads)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, hidden))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    """What training, evaluation and sampling need of any model a run trains (this decoder, or a ``transformers``
    model wrapped by model/pretrained.py): token ids (batch, seq) -> next-token logits (batch, seq, vocab), and the
    two limits of its input."""

    vocab_size: int
    max_seq_len: int

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy in nats, computed in fp32 whatever the autocast dtype. Called through
        ``forward(tokens, targets)``, so that a wrapper (DDP) that runs the forward sees the loss computed there."""
        loss: torch.Tensor = self(tokens, targets)
        return loss


class LlamaDecoder(CausalLM):
    """Token ids (batch, seq) -> next-token logits (batch, seq, vocab), or with targets the mean loss, computed
    from the last hidden states a chunk at a time (model/chunked_loss.py): the full logits are never held.

    How the blocks run is each member's own choice (training/step_plan.py), never part of the weights:
    :meth:`run_blocks` compiles each block with ``torch.compile`` and/or recomputes its activations in the backward
    pass (activation checkpointing)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.vocab_size = cfg.vocab_size
        self.max_seq_len = cfg.max_seq_len
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderBlock(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        cos, sin = rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        # Derived from the config, so not part of the state that is checkpointed or exchanged.
        self.rope_cos: torch.Tensor
        self.rope_sin: torch.Tensor
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # What runs each block: the blocks themselves, or their compiled forms. A plain list, so that compiled
        # wrappers are not registered as submodules (parameter names and the state dict stay the blocks').
        self._block_runners: list[Callable[..., torch.Tensor]] = list(self.layers)
        self.checkpoint_blocks = False
        self.compiled = False
        self.reset_parameters()

    def run_blocks(self, *, compiled: bool, checkpointed: bool) -> None:
        """Run each block compiled (``torch.compile``, one graph per block shape, shared by the blocks) or eager,
        and with or without activation checkpointing. The weights are untouched either way."""
        self._block_runners = [torch.compile(block) for block in self.layers] if compiled else list(self.layers)
        self.checkpoint_blocks = checkpointed
        self.compiled = compiled  # the loss's chunks are compiled with the blocks (model/chunked_loss.py)

    def reset_parameters(self) -> None:
        """GPT-2/Llama-style init; residual output projections scaled by 1/sqrt(2 * layers) to keep depth stable."""
        std = self.config.init_std
        residual_std = std / math.sqrt(2 * self.config.num_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                scale = residual_std if name.endswith(("o_proj", "down_proj")) else std
                nn.init.normal_(module.weight, mean=0.0, std=scale)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        seq = tokens.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len {self.config.max_seq_len}")
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        x = self.embed_tokens(tokens)
        for runner in self._block_runners:
            if self.checkpoint_blocks and torch.is_grad_enabled():
                # No randomness in a block (no dropout): nothing to replay, and no device state to capture (which a
                # CPU model on a machine with an untouched GPU would otherwise initialize mid-forward, refused).
                x = checkpoint(runner, x, cos, sin, use_reentrant=False, preserve_rng_state=False)
            else:
                x = runner(x, cos, sin)
        hidden = self.norm(x)
        if targets is None:
            return self.lm_head(hidden)
        return linear_cross_entropy(hidden, self.lm_head.weight, targets, compiled=self.compiled)


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in nats of ``logits`` (from the model, or from its DDP wrapper), in fp32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def parameter_count(cfg: ModelConfig) -> int:
    """Number of distinct parameters (tied embeddings counted once), computed without allocating weights."""
    with torch.device("meta"):
        model = LlamaDecoder(cfg)
    return sum(p.numel() for p in model.parameters())


def named_parameters_ordered(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """Distinct parameters in a stable order: the order the outer state, checkpoints and the wire all use."""
    yield from model.named_parameters(remove_duplicate=True)


def autocast_context(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """bf16 autocast on CUDA (weights stay fp32, matmuls run in bf16); plain fp32 on CPU."""
    if device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()
