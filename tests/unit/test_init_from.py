"""``--init-from``: a local Hugging Face folder of any causal LM starts a run with exactly its weights (same logits as
``transformers``), enters the run's identity, and comes back out of ``export`` in its own layout."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from noloco_node.cli.main import main
from noloco_node.config.models import DataConfig, OuterConfig, TrainConfig
from noloco_node.data.corpus import ReplicaShard
from noloco_node.errors import DataError
from noloco_node.model.export import checkpoint_weights
from noloco_node.model.pretrained import PretrainedDecoder, TransformersModel, open_pretrained
from noloco_node.model.run_model import model_source, run_model
from noloco_node.model.source import run_fingerprint
from noloco_node.training.replica import Replica
from noloco_node.training.solo import run_training

from ..hf_models import ARCHITECTURES, TEXT, save_model

transformers = pytest.importorskip("transformers")  # a dev dependency: CI installs it, so this runs there


def _text_data(tmp_path: Path) -> DataConfig:
    path = tmp_path / "text.txt"
    path.write_text(TEXT)
    return DataConfig(source=str(path), cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_a_folder_of_each_architecture_starts_a_replica_with_the_sources_logits(kind: str, tmp_path: Path) -> None:
    folder = save_model(kind, tmp_path / kind)
    train = TrainConfig(init_from=folder, seq_len=64, batch_size=4, total_steps=10, device="cpu")
    corpus, source = run_model(_text_data(tmp_path), train)
    assert corpus.tokenizer.json_text == (folder / "tokenizer.json").read_text()  # the folder's own tokenizer
    # A Llama this project's decoder represents (grouped-query attention included) loads into it; others run as
    # transformers builds them.
    assert isinstance(source, PretrainedDecoder if kind == "llama" else TransformersModel)
    replica = Replica(source, train, [ReplicaShard(corpus.train, replica=0, num_replicas=1, seq_len=64, seed=0)])
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens = torch.randint(0, 320, (2, 64), generator=torch.Generator().manual_seed(0))
    replica.model.eval()
    with torch.no_grad():
        ours, theirs = replica.model(tokens), reference(input_ids=tokens).logits
    scale = theirs.abs().max().item()
    assert scale > 0.1  # real, non-trivial logits
    assert torch.allclose(ours, theirs, atol=1e-5 * scale, rtol=1e-4), (ours - theirs).abs().max()
    # phi starts as theta, and every parameter is in the exchange layout, once (tied embeddings counted once)
    distinct = {id(p) for p in reference.parameters()}
    assert len(replica.phi) == len(source.layout()) == len(distinct)
    assert all(torch.equal(phi, p.detach()) for phi, p in zip(replica.phi, replica.params, strict=True))
    losses = [replica.train_step() for _ in range(8)]  # the one training loop trains it
    assert all(loss is not None and np.isfinite(float(loss)) for loss in losses)


def test_the_run_identity_covers_the_weights_not_how_they_are_stored(tmp_path: Path) -> None:
    folder = save_model("qwen2", tmp_path / "a")
    train = TrainConfig(init_from=folder, seq_len=64)
    identity = lambda t: run_fingerprint(model_source(t, 320), run_name="r", seed=0, tokenizer="tok")  # noqa: E731
    base = identity(train)
    # the same weights in two shards, with other file metadata: the same run
    resharded = tmp_path / "b"
    transformers.AutoModelForCausalLM.from_pretrained(folder).save_pretrained(resharded, max_shard_size="100KB")
    assert (resharded / "model.safetensors.index.json").is_file()
    shutil.copy(folder / "tokenizer.json", resharded)
    assert identity(train.model_copy(update={"init_from": resharded})) == base
    # one weight changed (another revision of the model): another run
    revised = tmp_path / "c"
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] += 1e-3
    model.save_pretrained(revised)
    assert identity(train.model_copy(update={"init_from": revised})) != base
    # and none of them is the run of the seeded decoder
    assert identity(TrainConfig(seq_len=64)) != base


def test_a_folder_missing_a_file_is_refused_with_the_file_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder = save_model("llama", tmp_path / "m")
    data = _text_data(tmp_path)
    broken = tmp_path / "broken"
    for missing, expected in (
        ("config.json", "no config.json"),
        ("model.safetensors", "no model.safetensors"),
        ("tokenizer.json", "no tokenizer.json"),
    ):
        shutil.rmtree(broken, ignore_errors=True)
        shutil.copytree(folder, broken)
        (broken / missing).unlink()
        with pytest.raises(DataError, match=expected):
            run_model(data, TrainConfig(init_from=broken, seq_len=64))
    with pytest.raises(DataError, match="no such folder"):
        open_pretrained(tmp_path / "nowhere")
    # the tokenizer given explicitly replaces the folder's missing one
    corpus, _ = run_model(data.model_copy(update={"tokenizer": folder / "tokenizer.json"}), TrainConfig(
        init_from=broken, seq_len=64))  # fmt: skip
    assert corpus.vocab_size == 320
    # through the command line: a message, no traceback, nothing written
    code = main(["train", "--init-from", str(tmp_path / "nowhere"), "--data", data.source, "--steps", "2",
                 "--checkpoint-dir", str(tmp_path / "ck")])  # fmt: skip
    assert code != 0 and "no such folder" in capsys.readouterr().err
    assert not (tmp_path / "ck" / "checkpoint.pt").exists()


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_export_writes_the_trained_weights_back_in_the_sources_own_layout(kind: str, tmp_path: Path) -> None:
    folder = save_model(kind, tmp_path / "source")
    train = TrainConfig(init_from=folder, seq_len=64, batch_size=4, total_steps=20, inner_steps=10, eval_batches=2)
    run_training(train, OuterConfig(), _text_data(tmp_path), checkpoint_dir=tmp_path / "ck", checkpoint_every=20)
    weights = checkpoint_weights(tmp_path / "ck")
    assert main(["export", "--from", "self", "--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "out")]) == 0
    source_config = json.loads((folder / "config.json").read_text())
    exported_config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert {k: v for k, v in exported_config.items() if k not in ("torch_dtype", "dtype", "transformers_version")} == {
        k: v for k, v in source_config.items() if k not in ("torch_dtype", "dtype", "transformers_version")
    }
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    original = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert type(reloaded) is type(original)
    tokens = torch.randint(0, 320, (1, 48), generator=torch.Generator().manual_seed(1))
    trained = weights.model().eval()
    with torch.no_grad():
        ours, theirs, before = trained(tokens), reloaded(input_ids=tokens).logits, original(input_ids=tokens).logits
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-4)  # the trained weights, in the source's layout
    assert not torch.allclose(theirs, before, atol=1e-3)  # and they are trained: not the starting point
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert hf_tokenizer("def f(x):")["input_ids"] == [int(i) for i in weights.tokenizer.encode("def f(x):")]
    # the export is itself a folder a new run can start from
    assert open_pretrained(tmp_path / "out").name == original.__class__.__name__


def test_a_byte_level_runs_export_continues_with_init_from(tmp_path: Path) -> None:
    """The round trip a user makes: train, export, start a new run from the export (bytes need no tokenizer file)."""
    train = TrainConfig(model_size="tiny", seq_len=64, batch_size=4, total_steps=20, inner_steps=10, eval_batches=2)
    data = _text_data(tmp_path)
    run_training(train, OuterConfig(), data, checkpoint_dir=tmp_path / "ck", checkpoint_every=20)
    assert main(["export", "--from", "self", "--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "m")]) == 0
    assert not (tmp_path / "m" / "tokenizer.json").exists()
    corpus, source = run_model(data, TrainConfig(init_from=tmp_path / "m", seq_len=64))
    assert corpus.tokenizer.fingerprint == "bytes" and isinstance(source, PretrainedDecoder)
    exported = checkpoint_weights(tmp_path / "ck").model().eval()
    continued = source.initial_model(torch.device("cpu")).eval()
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(continued(tokens), exported(tokens))


def test_a_node_says_at_start_when_its_model_will_not_fit_in_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    from noloco_node.node import machine_checks, memory

    monkeypatch.setattr(machine_checks, "available_memory", lambda: 24 * 2**30)
    assert memory.host_bytes_per_parameter(on_gpu=False) == 60 and memory.host_bytes_per_parameter(on_gpu=True) == 48
    assert machine_checks.host_memory(160_000_000, on_gpu=False).level == "ok"  # 9 GiB: fits
    short = machine_checks.host_memory(1_100_000_000, on_gpu=False)  # 61 GiB: does not
    assert short.level == "fail", short
    assert "1100.0M parameters x 60 B/param = 61.47 GiB" in short.detail and "24.00 GiB available" in short.detail
    assert "smaller --model" in short.fix


def test_a_local_swarm_says_when_its_nodes_do_not_fit_the_machine_together(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from noloco_node.node import machine_checks

    monkeypatch.setattr(machine_checks, "available_memory", lambda: 125 * 2**30)
    one_3b = 1_611_761_664
    assert machine_checks.host_memory(one_3b, on_gpu=True).level == "ok"  # one node alone fits (72 GiB)
    together = machine_checks.nodes_together(one_3b, True, 2, tmp_path)
    memory = [check for check in together if check.name == "host memory"]
    assert memory and memory[0].level == "fail"
    assert "2 nodes x 72.1 GiB = 144.1 GiB of host memory together, 125.0 GiB available" in memory[0].detail
    alone = machine_checks.nodes_together(one_3b, True, 1, tmp_path)
    assert not [check for check in alone if check.name == "host memory"]
