"""A swarm started from a saved Hugging Face model: real node processes, the real DHT and gRPC, a Qwen2 trained
through transformers. The two nodes started from it blend and learn; a third node of the same run name started
from another revision of the model is refused by both, before any exchange, with a message that says why."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from noloco_node.config.models import DataConfig, TrainConfig
from noloco_node.model.run_model import load_run_corpus

from ..hf_models import TEXT, save_model
from .swarm_harness import Bootstrap, NodeProcess, stop_all

transformers = pytest.importorskip("transformers")  # a dev dependency: CI installs it, so this runs there


@pytest.mark.slow  # --init-from has unit tests in the fast tier (tests/unit/test_init_from.py): `make test-slow`
def test_two_nodes_continue_a_saved_qwen2_and_refuse_a_node_started_from_another_revision(
    bootstrap: Bootstrap, tmp_path: Path
) -> None:
    model = save_model("qwen2", tmp_path / "qwen2")
    revised = tmp_path / "qwen2-revised"
    changed = transformers.AutoModelForCausalLM.from_pretrained(model)
    with torch.no_grad():
        changed.model.norm.weight.mul_(1.01)
    changed.save_pretrained(revised)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (revised / name).write_bytes((model / name).read_bytes())
    text = tmp_path / "text.txt"
    text.write_text(TEXT * 3)
    cache = tmp_path / "cache"
    # tokenized once here, so that the nodes share the cached corpus instead of racing to write it
    load_run_corpus(DataConfig(source=str(text), cache_dir=cache), TrainConfig(init_from=model))
    common = ["--data", str(text), "--cache-dir", str(cache), "--seq-len", "64", "--batch-size", "8"]
    common += ["--eval-batches", "4", "--inner-steps", "10", "--pair-timeout", "5", "--run-name", "continued"]
    common += ["--warmup-steps", "10"]  # the default, 10% of --steps, would keep the rate near 0 for the whole test
    first_model = ["--init-from", str(model), "--steps", "100000"]
    nodes = [
        NodeProcess(f"node{i}", bootstrap, tmp_path, *common, *first_model, "--shard-index", str(i)) for i in range(2)
    ]
    other = NodeProcess("other", bootstrap, tmp_path, *common, "--init-from", str(revised), "--steps", "100000")
    everyone = [*nodes, other]

    def settled() -> bool:
        """Each node has blended 6 times, and each of the three has seen (and refused) what the others started from."""
        statuses = [node.status() or {} for node in everyone]
        blended = all(sum(1 for h in s.get("history", []) if h["partner"]) >= 6 for s in statuses[:2])
        return blended and all(len(s.get("refused_peers", [])) == (2 if s is statuses[2] else 1) for s in statuses)

    try:
        deadline = time.monotonic() + 180
        while not settled():
            assert time.monotonic() < deadline, "\n".join(node.output()[-2000:] for node in everyone)
            time.sleep(0.5)
        stop_all(everyone)  # gracefully: the final status.json stays
        statuses = [node.status() for node in nodes]
        other_status = other.status()
        ids = {s["peer_id"] for s in statuses}
        for status in statuses:
            assert status["model_size"] == "Qwen2ForCausalLM"
            history = status["history"]
            partners = [h["partner"] for h in history if h["partner"]]
            assert set(partners) <= ids - {status["peer_id"]}  # never the node of the other revision
            first, last = history[0]["val_loss"], history[-1]["val_loss"]
            assert last < first - 0.1, (first, last)
            (refusal,) = status["refused_peers"]
            assert other_status["peer_id"] in refusal and "weights" in refusal and "config" not in refusal, refusal
        assert other_status["run_fingerprint"] != statuses[0]["run_fingerprint"]
        assert not [h for h in other_status["history"] if h["partner"]]
        for refusal in other_status["refused_peers"]:
            assert "started from a different model" in refusal and "weights" in refusal
        assert "started from a different model" in other.output()  # said in its log too
    finally:
        stop_all(everyone)
