"""A usable model out: exported safetensors + config load in transformers' LlamaForCausalLM with the same logits
and the same greedy continuation; eval and generate read exports and checkpoints; bad model files are refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from noloco_node.cli.main import main
from noloco_node.config.models import DataConfig, OuterConfig, TrainConfig, model_config_for
from noloco_node.data.tokenizer import ByteTokenizer, train_bpe_tokenizer
from noloco_node.errors import DataError
from noloco_node.model.checkpoint_file import load_checkpoint, save_checkpoint
from noloco_node.model.decoder import LlamaDecoder, named_parameters_ordered
from noloco_node.model.export import ExportedWeights, checkpoint_weights, load_any, write_export
from noloco_node.model.inference import generate
from noloco_node.model.source import SeededDecoder
from noloco_node.training.solo import run_training

transformers = pytest.importorskip("transformers")  # a dev dependency: CI installs it, so this runs there


def _perturbed_model(size: str, vocab: int) -> LlamaDecoder:
    """Random weights, with the norm gains moved off 1.0 so that a mix-up of any tensor shows in the logits."""
    torch.manual_seed(1)
    model = LlamaDecoder(model_config_for(size, vocab_size=vocab, max_seq_len=128))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model.eval()


def _export(model: LlamaDecoder, out: Path, tokenizer: object = None, dtype: str = "fp32") -> None:
    named = list(named_parameters_ordered(model))
    weights = ExportedWeights(
        SeededDecoder(model.config, seed=0),
        [n for n, _ in named],
        [p.detach() for _, p in named],
        tokenizer or ByteTokenizer(),
    )
    write_export(out, weights, dtype=dtype)


def test_an_exported_125m_model_loads_in_transformers_with_matching_logits(tmp_path: Path) -> None:
    model = _perturbed_model("125m", vocab=1024)
    _export(model, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 12
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert not hf.config.tie_word_embeddings  # the paper's sizes have separate input and output embeddings
    tokens = torch.randint(0, 1024, (2, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    scale = ours.abs().max().item()
    assert scale > 1.0  # the comparison is of real, non-trivial logits
    assert torch.allclose(ours, theirs, atol=1e-4 * scale, rtol=1e-4), (ours - theirs).abs().max()
    assert torch.equal(hf.model.layers[3].mlp.up_proj.weight, model.layers[3].mlp.up_proj.weight)
    back = load_any(tmp_path / "m").model().eval()  # and this package reads its own export exactly
    with torch.no_grad():
        assert torch.equal(back(tokens), ours)


def test_a_trained_checkpoint_exports_with_its_tokenizer_and_decodes_like_transformers(tmp_path: Path) -> None:
    from noloco_node.data.corpus import stdlib_source_files

    _, files = stdlib_source_files()
    tokenizer = train_bpe_tokenizer(
        (p.read_text(errors="replace") for p in sorted(files)[:150]), vocab_size=384, out=tmp_path / "tok.json"
    )
    train = TrainConfig(model_size="tiny", seq_len=64, batch_size=8, total_steps=120, inner_steps=40, eval_batches=2)
    data = DataConfig(source="stdlib", tokenizer=tmp_path / "tok.json", max_bytes=2**21, cache_dir=tmp_path / "c")
    run_training(train, OuterConfig(), data, checkpoint_dir=tmp_path / "ck", checkpoint_every=60)
    weights = checkpoint_weights(tmp_path / "ck")  # the slow weights phi, with the tokenizer the run used
    assert weights.tokenizer.fingerprint == tokenizer.fingerprint and weights.provenance["inner_step"] == 120
    assert main(["export", "--from", "self", "--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "m")]) == 0
    assert (tmp_path / "m" / "tokenizer.json").read_text() == tokenizer.json_text
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "m").eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "m")
    prompt = "def main():\n    "
    assert hf_tokenizer(prompt)["input_ids"] == [int(i) for i in tokenizer.encode(prompt)]
    ours = generate(weights.model(), weights.tokenizer, prompt, max_new_tokens=24, temperature=0)
    with torch.no_grad():
        ids = hf_tokenizer(prompt, return_tensors="pt")["input_ids"]
        out = hf.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ours and ours == hf_tokenizer.decode(out[0, ids.shape[1] :])
    # a run ends on an outer step (theta == phi); a checkpoint taken mid-phase has fast weights of its own
    payload = load_checkpoint(tmp_path / "ck" / "checkpoint.pt")
    payload["replica"]["theta"][0] = payload["replica"]["theta"][0] + 0.5
    save_checkpoint(tmp_path / "mid" / "checkpoint.pt", {k: v for k, v in payload.items() if k != "format"})
    fast = checkpoint_weights(tmp_path / "mid", weights="fast")
    assert torch.equal(fast.tensors[0], weights.tensors[0] + 0.5) and fast.provenance["weights"] == "theta (fast)"
    # bf16 exports halve the file
    _export(weights.model(), tmp_path / "bf16", weights.tokenizer, dtype="bf16")
    size = lambda p: (p / "model.safetensors").stat().st_size  # noqa: E731
    assert size(tmp_path / "bf16") < 0.55 * size(tmp_path / "m")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_eval_and_generate_commands_read_exports_and_checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model = _perturbed_model("tiny", vocab=256)
    _export(model, tmp_path / "m")
    text = tmp_path / "text.txt"
    text.write_text("".join(f"line {i}: the quick brown fox\n" for i in range(3000)))
    assert main(["eval", str(tmp_path / "m"), "--data", str(text), "--seq-len", "32", "--batches", "3", "--json",
                 "--cache-dir", str(tmp_path / "cache")]) == 0  # fmt: skip
    result = json.loads(capsys.readouterr().out)
    assert result["tokens"] == 3 * 8 * 32 and result["perplexity"] == pytest.approx(np.exp(result["loss"]))
    assert 4.0 < result["loss"] < 8.0  # an untrained byte model: about ln(256) = 5.5
    assert main(["generate", str(tmp_path / "m"), "--prompt", "line ", "--max-new-tokens", "12", "--samples", "2",
                 "--seed", "3"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert printed.count("--- sample") == 2 and printed.count("line ") >= 2
    again = generate(model, ByteTokenizer(), "line ", max_new_tokens=12, temperature=0.8, top_k=50, seed=3)
    assert "line " + again in printed  # seeded sampling is reproducible


def test_bad_model_files_are_refused_with_the_file_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model = _perturbed_model("tiny", vocab=256)
    _export(model, tmp_path / "m")
    with pytest.raises(DataError, match="exists"):
        _export(model, tmp_path / "m")  # never overwrites a model
    with pytest.raises(DataError, match="neither an exported model"):
        load_any(tmp_path)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((tmp_path / "m" / "config.json").read_text())
    (broken / "model.safetensors").write_bytes((tmp_path / "m" / "model.safetensors").read_bytes()[:5000])
    with pytest.raises(DataError, match=r"broken/model\.safetensors"):
        load_any(broken)
    assert main(["eval", str(broken)]) == 2
    assert "broken/model.safetensors" in capsys.readouterr().err
    other = tmp_path / "other"
    other.mkdir()
    _export(_perturbed_model("small", vocab=256), other / "m")
    (broken / "model.safetensors").write_bytes((other / "m" / "model.safetensors").read_bytes())
    with pytest.raises(DataError, match=r"broken: missing weights \[\], unexpected weights \['layers\.2"):
        load_any(broken).model()  # tiny's config (2 layers) with small's weights (4 layers, wider)
