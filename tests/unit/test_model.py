"""The Llama-style decoder: shapes, causality, RoPE, tying, named sizes, seeded initialisation."""

from __future__ import annotations

import pytest
import torch

from noloco_node.config.models import MODEL_SIZES, ModelConfig, model_config_for
from noloco_node.model.decoder import LlamaDecoder, apply_rotary, autocast_context, parameter_count, rotary_tables
from noloco_node.model.source import SeededDecoder


def tiny(**overrides: object) -> ModelConfig:
    return model_config_for("tiny", vocab_size=256, max_seq_len=32, **overrides)


def test_forward_shape_and_finite_loss() -> None:
    model = LlamaDecoder(tiny())
    tokens = torch.randint(0, 256, (3, 32))
    logits = model(tokens)
    assert logits.shape == (3, 32, 256)
    loss = model.loss(tokens[:, :-1], tokens[:, 1:])
    # A fresh model predicts nearly uniformly: the loss is close to ln(256).
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.3


def test_attention_is_causal() -> None:
    model = LlamaDecoder(tiny()).eval()
    tokens = torch.randint(0, 256, (1, 20))
    changed = tokens.clone()
    changed[0, 15] = (tokens[0, 15] + 1) % 256
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[0, :15], b[0, :15])
    assert not torch.allclose(a[0, 15:], b[0, 15:])


def test_rotary_preserves_norm_and_encodes_relative_position() -> None:
    cos, sin = rotary_tables(16, 64, 10000.0)
    q, k = torch.randn(16), torch.randn(16)
    rotate = lambda x, pos: apply_rotary(x.view(1, 1, 1, 16), cos[pos : pos + 1], sin[pos : pos + 1]).flatten()  # noqa: E731
    assert torch.linalg.vector_norm(rotate(q, 7)).item() == pytest.approx(torch.linalg.vector_norm(q).item(), rel=1e-5)
    # <R(m) q, R(n) k> depends only on m - n.
    assert torch.dot(rotate(q, 10), rotate(k, 4)).item() == pytest.approx(
        torch.dot(rotate(q, 26), rotate(k, 20)).item(), rel=1e-4, abs=1e-5
    )


def test_longer_than_max_seq_len_is_refused() -> None:
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        LlamaDecoder(tiny())(torch.zeros(1, 33, dtype=torch.long))


def test_tied_and_untied_embeddings() -> None:
    tied = LlamaDecoder(tiny(tie_embeddings=True))
    untied = LlamaDecoder(tiny(tie_embeddings=False))
    assert tied.lm_head.weight is tied.embed_tokens.weight
    assert untied.lm_head.weight is not untied.embed_tokens.weight
    assert parameter_count(untied.config) - parameter_count(tied.config) == 256 * 64


def test_named_sizes_have_the_papers_shapes() -> None:
    assert [MODEL_SIZES[s]["hidden_size"] for s in ("125m", "1.3b", "6.8b")] == [768, 2048, 4096]
    assert [MODEL_SIZES[s]["num_layers"] for s in ("125m", "1.3b", "6.8b")] == [12, 24, 32]
    assert [MODEL_SIZES[s]["intermediate_size"] for s in ("125m", "1.3b", "6.8b")] == [3072, 8192, 16384]


@pytest.mark.parametrize("size", list(MODEL_SIZES))
def test_parameter_count_matches_the_closed_form(size: str) -> None:
    cfg = model_config_for(size, vocab_size=32000, max_seq_len=2048)
    h, f, v, layers = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
    per_layer = 4 * h * h + 3 * h * f + 2 * h  # attention, SwiGLU, two RMSNorm weights
    embeddings = v * h * (1 if cfg.tie_embeddings else 2)
    assert parameter_count(cfg) == layers * per_layer + embeddings + h  # + final norm


def test_bad_shapes_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="divisible by num_heads"):
        ModelConfig(hidden_size=64, num_heads=5)
    with pytest.raises(ValueError, match="unknown model size"):
        model_config_for("huge", vocab_size=256, max_seq_len=32)


def test_initial_weights_are_a_function_of_the_seed_only() -> None:
    torch.manual_seed(123)  # the global RNG must not matter
    a = SeededDecoder(tiny(), seed=7).initial_model(torch.device("cpu"))
    torch.manual_seed(456)
    b = SeededDecoder(tiny(), seed=7).initial_model(torch.device("cpu"))
    c = SeededDecoder(tiny(), seed=8).initial_model(torch.device("cpu"))
    for (name, pa), (_, pb), (_, pc) in zip(
        a.named_parameters(), b.named_parameters(), c.named_parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name
        if "layernorm" not in name and not name.startswith("norm"):
            assert not torch.equal(pa, pc), name


def test_cpu_runs_in_fp32() -> None:
    model = LlamaDecoder(tiny())
    with autocast_context(torch.device("cpu")):
        logits = model(torch.randint(0, 256, (1, 8)))
    assert logits.dtype == torch.float32
