"""The GPU step's features shown on the CPU with the same maths: the chunked loss, grouped-query attention without
copies, compiled blocks, gradient accumulation, and the planner against a card of a given memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from noloco_node.config.models import TrainConfig, model_config_for
from noloco_node.data.corpus import ReplicaShard
from noloco_node.model import chunked_loss
from noloco_node.model.decoder import LlamaDecoder, token_loss
from noloco_node.model.source import SeededDecoder
from noloco_node.training.replica import Replica
from noloco_node.training.step_plan import (
    GIB,
    MEMORY_MARGIN,
    fewest_ranks_to_fit,
    largest_divisor_at_most,
    model_memory,
    plan_for_memory,
)

TOKENS = (np.arange(200_000) * 7919 % 251).astype(np.uint8)


def make_replica(**train: object) -> Replica:
    cfg = TrainConfig(
        **{"seq_len": 32, "batch_size": 8, "total_steps": 100, "warmup_steps": 2, "device": "cpu", **train}
    )
    source = SeededDecoder(model_config_for("tiny", vocab_size=256, max_seq_len=32), seed=0)
    return Replica(source, cfg, [ReplicaShard(TOKENS, replica=0, num_replicas=1, seq_len=32, seed=0)])


def test_the_chunked_loss_and_its_gradients_are_the_plain_losses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chunked_loss, "CHUNK_ELEMENTS", 3 * 50)  # chunks of 3 rows, the last one shorter
    torch.manual_seed(0)
    hidden = torch.randn(2, 7, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (2, 7))
    plain = F.cross_entropy((hidden @ weight.T).reshape(-1, 50), targets.reshape(-1))
    plain_grads = torch.autograd.grad(plain * 2.5, [hidden, weight])
    with torch.autocast("cpu", enabled=False):
        rows, projection = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
        chunked = chunked_loss.linear_cross_entropy(rows, projection, targets)
        chunked_grads = torch.autograd.grad(chunked * 2.5, [rows, projection])  # an upstream gradient scales both
    assert chunked.item() == pytest.approx(plain.item(), rel=1e-6)
    for mine, reference in zip(chunked_grads, plain_grads, strict=True):
        assert torch.allclose(mine.double(), reference, atol=1e-6, rtol=1e-5)
    with torch.no_grad():  # evaluation: the loss alone, the same value
        assert chunked_loss.linear_cross_entropy(rows, projection, targets).item() == pytest.approx(plain.item())


def test_the_decoder_loss_is_the_loss_of_its_logits() -> None:
    model = LlamaDecoder(model_config_for("tiny", vocab_size=256, max_seq_len=32))
    tokens = torch.randint(0, 256, (3, 32))
    assert model.loss(tokens, tokens).item() == pytest.approx(token_loss(model(tokens), tokens).item(), rel=1e-5)


def test_grouped_query_attention_reads_shared_heads_without_copies() -> None:
    cfg = model_config_for("tiny", vocab_size=256, max_seq_len=16, num_kv_heads=2)
    attention = LlamaDecoder(cfg).layers[0].self_attn
    x = torch.randn(2, 16, cfg.hidden_size)
    cos, sin = LlamaDecoder(cfg).rope_cos[:16], LlamaDecoder(cfg).rope_sin[:16]
    out = attention(x, cos, sin)

    def heads(t: torch.Tensor, count: int) -> torch.Tensor:
        return t.view(2, 16, count, cfg.head_dim).transpose(1, 2)

    from noloco_node.model.decoder import apply_rotary

    q = apply_rotary(heads(attention.q_proj(x), 4), cos, sin)
    k = apply_rotary(heads(attention.k_proj(x), 2), cos, sin).repeat_interleave(2, dim=1)
    v = heads(attention.v_proj(x), 2).repeat_interleave(2, dim=1)
    copied = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    reference = attention.o_proj(copied.transpose(1, 2).reshape(2, 16, cfg.hidden_size))
    assert torch.allclose(out, reference, atol=1e-5)


@pytest.mark.slow  # torch.compile from a cold cache takes 25 s on 2 CPUs (4 s warm): `make test-slow`
def test_compiled_blocks_compute_what_eager_blocks_do() -> None:
    cfg = model_config_for("tiny", vocab_size=256, max_seq_len=16, num_layers=1)
    model = LlamaDecoder(cfg)
    tokens = torch.randint(0, 256, (2, 16))
    eager_loss = model(tokens, tokens)
    eager_grads = torch.autograd.grad(eager_loss, list(model.parameters()))
    model.run_blocks(compiled=True, checkpointed=True)  # checkpointed too: recomputed in the backward pass
    assert all(isinstance(runner, torch._dynamo.eval_frame.OptimizedModule) for runner in model._block_runners)
    compiled_loss = model(tokens, tokens)
    compiled_grads = torch.autograd.grad(compiled_loss, list(model.parameters()))
    assert compiled_loss.item() == pytest.approx(eager_loss.item(), rel=1e-5)
    for mine, reference in zip(compiled_grads, eager_grads, strict=True):
        assert torch.allclose(mine, reference, atol=1e-5, rtol=1e-4)
    assert [name for name, _ in model.named_parameters()] == [
        name for name, _ in LlamaDecoder(cfg).named_parameters()
    ]  # the compiled wrappers are no submodules: names, state dict and wire stay the blocks'


def test_accumulated_micro_batches_train_as_one_large_batch() -> None:
    whole, accumulated = make_replica(), make_replica(micro_batch=2)
    assert (whole.plan.micro_batch, whole.plan.accumulation) == (8, 1)
    assert (accumulated.plan.micro_batch, accumulated.plan.accumulation) == (2, 4)
    for _ in range(3):
        loss_whole, loss_accumulated = whole.train_step(), accumulated.train_step()
        assert loss_whole is not None and loss_accumulated is not None
        assert float(loss_accumulated) == pytest.approx(float(loss_whole), rel=1e-5)
        assert loss_accumulated.grad_norm == pytest.approx(loss_whole.grad_norm, rel=1e-4)
    for a, b in zip(whole.params, accumulated.params, strict=True):
        assert torch.allclose(a, b, atol=1e-5)  # Adam moves each weight by up to lr (3e-3) a step
    assert whole.shards[0].position == accumulated.shards[0].position  # the same sequences were read


def test_a_micro_batch_that_does_not_divide_the_batch_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="micro_batch"):
        TrainConfig(batch_size=8, micro_batch=3)


def test_the_planner_fits_the_micro_batch_to_a_cards_memory() -> None:
    train = TrainConfig(model_size="125m", batch_size=256, seq_len=1024)
    cfg = model_config_for("125m", vocab_size=32000, max_seq_len=1024)
    memory = model_memory(cfg, 1024)
    for gib in (8, 24, 80):
        plan = plan_for_memory(cfg, train, gib * GIB)
        assert train.batch_size % plan.micro_batch == 0
        assert memory.micro_batch_fits(plan.micro_batch, gib * GIB)
        # the next divisor of the batch would not fit
        larger = plan.micro_batch * 2
        assert larger > train.batch_size or not memory.micro_batch_fits(larger, gib * GIB)
        assert plan.accumulation * plan.micro_batch == 256 and not plan.checkpointed
    assert plan_for_memory(cfg, train, 8 * GIB).micro_batch < plan_for_memory(cfg, train, 80 * GIB).micro_batch


def test_the_planner_checkpoints_when_one_sequence_does_not_fit_and_refuses_what_never_fits() -> None:
    train = TrainConfig(model_size="1.3b", batch_size=64, seq_len=4096)
    cfg = model_config_for("1.3b", vocab_size=32000, max_seq_len=4096)
    plain, checkpointed = model_memory(cfg, 4096), model_memory(cfg, 4096, checkpointed=True)
    card = int((plain.fixed_bytes + 0.5 * plain.per_sequence_bytes) / MEMORY_MARGIN)  # one sequence does not fit
    plan = plan_for_memory(cfg, train, card)
    assert plan.checkpointed and plan.micro_batch >= 1 and checkpointed.micro_batch_fits(plan.micro_batch, card)
    big = model_config_for("6.8b", vocab_size=32000, max_seq_len=1024)
    refused = plan_for_memory(big, TrainConfig(model_size="6.8b", batch_size=64, seq_len=1024), 80 * GIB)
    assert refused.micro_batch == 0 and "does not fit" in refused.notes[0] and "GiB" in refused.notes[0]


def test_a_member_sharding_the_model_holds_its_share_of_it_and_the_units_it_gathers() -> None:
    cfg = model_config_for("6.8b", vocab_size=32000, max_seq_len=1024)
    whole, halves, quarters = (model_memory(cfg, 1024, ranks=ranks) for ranks in (1, 2, 4))
    gathered = halves.fixed_bytes - whole.fixed_bytes / 2  # the root and two blocks, fp32, whole on every rank
    assert 0 < gathered < 0.05 * whole.fixed_bytes
    assert quarters.fixed_bytes == pytest.approx(whole.fixed_bytes / 4 + gathered, rel=1e-6)
    assert halves.per_sequence_bytes == whole.per_sequence_bytes  # each rank computes its own micro-batches
    train = TrainConfig(model_size="6.8b", batch_size=64, seq_len=1024)
    assert plan_for_memory(cfg, train, 80 * GIB).micro_batch == 0  # not on one H100
    sharded = fewest_ranks_to_fit(cfg, train, 80 * GIB)
    assert sharded is not None and sharded.ranks >= 2 and sharded.micro_batch >= 1  # the fewest that fit
    fewer = plan_for_memory(cfg, train, 80 * GIB, ranks=sharded.ranks - 1)
    assert fewer.micro_batch == 0 or fewer.notes
    assert not sharded.outer_state_on_device  # rank 0 keeps the outer state on its host
    assert f"sharded over {sharded.ranks} ranks" in sharded.summary()
    assert fewest_ranks_to_fit(cfg, train, 16 * GIB) is None  # eight 16 GiB cards are not enough


def test_the_planner_keeps_the_outer_state_on_the_gpu_only_where_the_micro_batch_stays_the_same() -> None:
    train = TrainConfig(model_size="1.3b", batch_size=64, seq_len=1024)
    cfg = model_config_for("1.3b", vocab_size=256, max_seq_len=1024)
    memory = model_memory(cfg, 1024)
    assert memory.outer_state_bytes == 8 * (memory.fixed_bytes // 16)  # phi and delta in fp32
    roomy = plan_for_memory(cfg, train, 80 * GIB)  # 24 GiB fixed + 12 GiB outer state leave 8 sequences of 3.2
    assert roomy.outer_state_on_device and roomy.micro_batch == 8
    assert memory.micro_batch_fits(8, 80 * GIB, besides=memory.outer_state_bytes)
    assert "outer state on the GPU" in roomy.summary()
    tight = plan_for_memory(cfg, train, 40 * GIB)  # the outer state would leave no sequence: it stays on the host
    assert not tight.outer_state_on_device and tight.micro_batch == 2 and "outer state on the host" in tight.summary()
    assert memory.largest_micro_batch(64, 40 * GIB, besides=memory.outer_state_bytes) == 0
    # Each member's own choice, either way; asked for on the GPU where it leaves no room, the plan says so.
    host = plan_for_memory(cfg, train.model_copy(update={"outer_state": "host"}), 80 * GIB)
    assert not host.outer_state_on_device and host.micro_batch == 8
    forced = plan_for_memory(cfg, train.model_copy(update={"outer_state": "device"}), 40 * GIB)
    assert forced.outer_state_on_device and forced.micro_batch == 0 and "does not fit" in forced.notes[0]
    assert "12.0 GiB of outer state on the GPU" in forced.notes[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the outer state has two places only beside a GPU")
def test_the_outer_step_on_the_gpu_computes_what_the_host_computes() -> None:
    """The same replica, its outer state on the GPU and in pinned host memory: the norm bound's movement, the
    blend with a partner's host tensors, its loss and the adopted weights agree."""
    from noloco_node import algorithm
    from noloco_node.security.payload_guard import relative_distances

    on_gpu = make_replica(device="cuda", micro_batch=8, compile="off", outer_state="device")
    for _ in range(3):
        on_gpu.train_step()
    on_host = make_replica(device="cuda", micro_batch=8, compile="off", outer_state="host")
    on_host.load_state_dict(on_gpu.state_dict())  # the same theta, phi, delta and Adam state
    results = {}
    for where, replica in (("device", on_gpu), ("host", on_host)):
        assert replica.outer_device.type == ("cuda" if where == "device" else "cpu")
        partner = [t.clone().mul_(1.01) for t in replica.fast_weights()]  # on the host, as the wire delivers
        movement = relative_distances(replica.outer_theta(), replica.phi)[0]
        new_phi, new_delta = algorithm.noloco_pair_step(
            replica.outer_theta(), replica.phi, replica.delta, (partner, [], []), alpha=0.5, beta=0.7, gamma=0.7
        )
        assert all(t.device.type == replica.outer_device.type for t in new_phi)
        validation = [replica.shards[0].next_batch(4)]
        loss = replica.loss_of(new_phi, validation)
        replica.apply_outer_step(new_phi, new_delta)
        results[where] = (movement, loss, [p.detach().cpu() for p in replica.params])
    (movement, loss, weights), (host_movement, host_loss, host_weights) = results["device"], results["host"]
    assert movement == pytest.approx(host_movement, rel=1e-5) and loss == pytest.approx(host_loss, rel=1e-5)
    for mine, reference in zip(weights, host_weights, strict=True):
        assert torch.allclose(mine, reference, atol=1e-6)


def test_largest_divisor() -> None:
    assert largest_divisor_at_most(256, 100) == 64
    assert largest_divisor_at_most(12, 5) == 4
    assert largest_divisor_at_most(7, 0) == 0
