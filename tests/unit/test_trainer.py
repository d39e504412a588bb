"""The inner loop's schedule, clipping and outer-state plumbing, and checkpoints that restore everything."""

from __future__ import annotations

import copy as copy_module
import itertools
import math
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch

from noloco_node import algorithm
from noloco_node.config.models import TrainConfig, model_config_for
from noloco_node.data.corpus import ReplicaShard
from noloco_node.model.checkpoint_file import load_checkpoint, save_checkpoint
from noloco_node.model.source import SeededDecoder
from noloco_node.training.checkpoints import CheckpointWriter, Snapshots, replica_state_of
from noloco_node.training.replica import Replica, learning_rate

TOKENS = (np.arange(200_000) * 7919 % 251).astype(np.uint8)  # deterministic, learnable-ish stream


def make_replica(seed: int = 0, shards: int = 1, **train: object) -> Replica:
    cfg = TrainConfig(seq_len=32, batch_size=4, total_steps=100, warmup_steps=10, seed=seed, device="cpu", **train)
    model_cfg = SeededDecoder(model_config_for("tiny", vocab_size=256, max_seq_len=32), seed=seed)
    return Replica(
        model_cfg,
        cfg,
        [ReplicaShard(TOKENS, replica=r, num_replicas=shards, seq_len=32, seed=seed) for r in range(shards)],
    )


def test_schedule_warms_up_linearly_then_decays_by_cosine_to_a_tenth() -> None:
    cfg = TrainConfig(lr=1e-3, warmup_steps=10, total_steps=110)
    assert learning_rate(0, cfg) == pytest.approx(1e-4)
    assert learning_rate(4, cfg) == pytest.approx(5e-4)
    assert learning_rate(9, cfg) == pytest.approx(1e-3)
    assert learning_rate(10, cfg) == pytest.approx(1e-3)
    assert learning_rate(60, cfg) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))  # half-way through the cosine
    assert learning_rate(110, cfg) == pytest.approx(1e-4)
    assert learning_rate(500, cfg) == pytest.approx(1e-4)  # stays at the floor past the end
    values = [learning_rate(s, cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(values))


def test_adam_has_no_weight_decay_and_clipping_bounds_the_update() -> None:
    replica = make_replica(grad_clip=1e-6)
    assert all(group["weight_decay"] == 0.0 for group in replica.optimizer.param_groups)
    step = replica.train_step()
    assert step is not None
    # With a clip this small the reported pre-clip norm is large but the gradients Adam saw were clipped.
    clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in replica.params]))
    assert step.grad_norm > 1e-3
    assert clipped.item() <= 1e-6 * 1.01


def test_outer_step_restarts_the_inner_phase_from_the_new_slow_weights() -> None:
    replica = make_replica()
    start = [p.clone() for p in replica.phi]
    train(replica, 5)
    assert not torch.equal(replica.params[0].detach(), start[0])
    new_phi, new_delta = algorithm.noloco_outer_step(
        replica.fast_weights(), replica.phi, replica.delta, [], [], alpha=0.5, beta=0.7, gamma=0.7
    )
    adam_state_before = {k: v.clone() for k, v in replica.optimizer.state[replica.params[0]].items()}
    replica.apply_outer_step(new_phi, new_delta)
    assert replica.outer_step == 1
    for param, phi, want in zip(replica.params, replica.phi, new_phi, strict=True):
        assert torch.equal(param.detach(), want) and torch.equal(phi, want)
    # Adam's state is neither reset nor averaged at an outer step.
    for key, value in replica.optimizer.state[replica.params[0]].items():
        assert torch.equal(value, adam_state_before[key])


def train(replica: Replica, steps: int) -> list[float]:
    return [float(loss) for loss in (replica.train_step() for _ in range(steps)) if loss is not None]


def test_a_checkpoint_from_the_outer_state_copy_resumes_bit_exactly(tmp_path: Path) -> None:
    """The node checkpoints from one copy of the state taken at the outer step (training/checkpoints.py), written
    by another thread while training goes on: resuming from it is the same as from the live state there."""
    a = make_replica(seed=3)
    train(a, 7)
    a.apply_outer_step(
        *algorithm.noloco_outer_step(a.fast_weights(), a.phi, a.delta, [], [], alpha=0.5, beta=0.7, gamma=0.7)
    )
    copies = Snapshots(a)
    copy = copies.take(a)
    live = make_replica(seed=3)
    live.load_state_dict(copy_module.deepcopy(a.state_dict()))  # torch keeps references to Adam's tensors
    train(a, 4)  # the trainer goes on while the copy is written: the copy must not change
    writer = CheckpointWriter(tmp_path / "ckpt.pt")
    writer.start()
    writer.submit(lambda: {"replica": replica_state_of(copy)}, copy.release)
    assert writer.close(timeout=30) and writer.written == 1 and copy.holders == 0
    b = make_replica(seed=3)
    b.load_state_dict(load_checkpoint(tmp_path / "ckpt.pt")["replica"])
    assert (b.inner_step, b.outer_step) == (7, 1)
    assert train(b, 5) == train(live, 5)
    for x, y in zip([*live.params, *live.phi, *live.delta], [*b.params, *b.phi, *b.delta], strict=True):
        assert torch.equal(x, y)


def test_the_final_checkpoint_mid_phase_from_the_snapshot_pool_resumes_bit_exactly(tmp_path: Path) -> None:
    """A node that stops mid-phase checkpoints its live state from a snapshot set and theta's host copy (node/
    trainer.py final_checkpoint), not a clone: resuming from it is the same as from Replica.state_dict."""
    a = make_replica(seed=4)
    train(a, 6)
    a.apply_outer_step(
        *algorithm.noloco_outer_step(a.fast_weights(), a.phi, a.delta, [], [], alpha=0.5, beta=0.7, gamma=0.7)
    )
    train(a, 3)  # mid-phase: theta is not phi
    copy = Snapshots(a).take(a)
    save_checkpoint(tmp_path / "final.pt", {"replica": {**replica_state_of(copy), "theta": a.fast_weights()}})
    copy.release()
    reference = make_replica(seed=4)
    reference.load_state_dict(copy_module.deepcopy(a.state_dict()))
    b = make_replica(seed=4)
    b.load_state_dict(load_checkpoint(tmp_path / "final.pt")["replica"])
    assert (b.inner_step, b.outer_step) == (9, 1)
    assert not all(torch.equal(p, phi) for p, phi in zip(b.params, b.phi, strict=True))
    assert train(b, 4) == train(reference, 4)
    for x, y in zip([*reference.params, *reference.phi, *reference.delta], [*b.params, *b.phi, *b.delta], strict=True):
        assert torch.equal(x, y)


def test_ddp_replica_averages_the_gradients_of_every_shard() -> None:
    model_cfg = SeededDecoder(model_config_for("tiny", vocab_size=256, max_seq_len=32), seed=0)
    cfg = TrainConfig(seq_len=32, batch_size=4, total_steps=100, grad_clip=1e9, device="cpu")  # no clipping
    shard = lambda r: ReplicaShard(TOKENS, replica=r, num_replicas=3, seq_len=32, seed=0)  # noqa: E731
    ddp = Replica(model_cfg, cfg, [shard(0), shard(1), shard(2)])
    singles = [Replica(model_cfg, cfg, [shard(r)]) for r in range(3)]
    ddp.train_step()
    for single in singles:
        single.train_step()
    for k, param in enumerate(ddp.params):
        mean = sum(single.params[k].grad for single in singles) / 3
        torch.testing.assert_close(param.grad, mean, rtol=1e-4, atol=1e-8)


def test_state_dict_restores_training_bit_exactly(tmp_path: Path) -> None:
    a = make_replica(seed=3)
    train(a, 7)
    a.apply_outer_step(
        *algorithm.noloco_outer_step(a.fast_weights(), a.phi, a.delta, [], [], alpha=0.5, beta=0.7, gamma=0.7)
    )
    train(a, 3)
    save_checkpoint(tmp_path / "ckpt.pt", {"replica": a.state_dict()})
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # no temporary files left behind
    b = make_replica(seed=3)
    b.load_state_dict(load_checkpoint(tmp_path / "ckpt.pt")["replica"])
    assert (b.inner_step, b.outer_step) == (10, 1)
    losses_a, losses_b = train(a, 6), train(b, 6)
    assert losses_a == losses_b
    for x, y in zip([*a.params, *a.phi, *a.delta], [*b.params, *b.phi, *b.delta], strict=True):
        assert torch.equal(x, y)


def test_loading_a_mismatched_state_changes_nothing() -> None:
    a = make_replica()
    state = a.state_dict()
    state["phi"][1] = torch.zeros(3, 3)
    b = make_replica(seed=5)
    before = [p.clone() for p in b.params]
    with pytest.raises(ValueError, match="shape"):
        b.load_state_dict(state)
    assert all(torch.equal(x, y) for x, y in zip(before, b.params, strict=True))
    assert b.inner_step == 0


def test_evaluate_is_a_loss_in_nats() -> None:
    replica = make_replica()
    batch = replica.shards[0].next_batch(4)
    loss = replica.evaluate([batch])
    assert abs(loss - math.log(256)) < 0.3


def test_steps_taken_while_waiting_are_borrowed_from_the_next_phase_and_keep_its_boundary() -> None:
    """--train-while-waiting: inner steps during the wait leave at least half of the next phase to it and stop
    before the run's end, so the next phase still ends at its boundary and no step is added."""
    from noloco_node.node.outer_step import StepsWhileWaiting
    from noloco_node.training.loop import InnerLoop

    replica = make_replica()
    cfg = replica.train_cfg.model_copy(update={"inner_steps": 5, "total_steps": 12})
    seen: list[int] = []
    phases = InnerLoop(replica, total_steps=12, inner_steps=5).phases()
    next(phases)  # steps 1-5
    steps = StepsWhileWaiting(replica, cfg, [lambda r, loss, s: seen.append(r.inner_step)], lambda: False)
    while steps():
        pass
    assert replica.inner_step == 7 and seen == [6, 7] and len(steps.losses) == 2 and steps.seconds > 0
    assert len(next(phases).losses) == 3 and replica.inner_step == 10  # the next phase still ends at 2H
    steps = StepsWhileWaiting(replica, cfg, [], lambda: False)
    assert steps() and not steps() and replica.inner_step == 11  # one short of the run's end (12)
    assert len(next(phases).losses) == 1 and replica.inner_step == 12
    stopping = StepsWhileWaiting(replica, cfg.model_copy(update={"total_steps": 100}), [], lambda: True)
    assert not stopping() and replica.inner_step == 12  # a stop request: no borrowed step


def test_a_donors_state_gives_its_slow_weights_and_counters_and_nothing_else() -> None:
    """Outer momentum and Adam's moments are rebuilt by the adopter, never taken from a donor: moments of 1 and 0
    (served once under two free keys) would otherwise turn Adam's first steps into steps of lr / eps."""
    donor = make_replica(seed=1)
    train(donor, 12)
    poisoned: dict[str, torch.Tensor] = {}
    for name, phi in zip(donor.names, donor.params, strict=True):
        poisoned[f"phi/{name}"] = phi.detach().clone()
        poisoned[f"delta/{name}"] = torch.full_like(phi, 5.0)
        poisoned[f"adam.exp_avg/{name}"] = torch.ones_like(phi)
        poisoned[f"adam.exp_avg_sq/{name}"] = torch.zeros_like(phi)
    joiner = make_replica(seed=0)
    joiner.adopt_donor_weights(poisoned, outer_step=1, inner_step=12)
    assert joiner.optimizer.state == {} and (joiner.outer_step, joiner.inner_step) == (1, 12)
    for name, param, phi, delta in zip(joiner.names, joiner.params, joiner.phi, joiner.delta, strict=True):
        assert torch.equal(phi, poisoned[f"phi/{name}"]) and torch.equal(param, phi) and not delta.any()
    losses = train(joiner, 5)
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < 1.2 * train(donor, 1)[0]


def test_moving_the_clock_forward_keeps_the_weights_and_the_phase_boundaries() -> None:
    """A node that rejoins its swarm's clock after a split (node/outer_step.py) keeps everything it trained; its
    counters move by whole phases, never past the run's end, and never backwards."""
    replica = make_replica(inner_steps=10)
    train(replica, 10)
    replica.apply_outer_step([p.detach().clone() for p in replica.params], list(replica.delta))
    weights = [p.detach().clone() for p in replica.params]
    replica.advance_clock(4)
    assert (replica.outer_step, replica.inner_step) == (4, 40)
    assert all(torch.equal(p, w) for p, w in zip(replica.params, weights, strict=True))
    replica.advance_clock(50)
    assert (replica.outer_step, replica.inner_step) == (50, 100)  # total_steps is 100: the run ends there
    with pytest.raises(ValueError, match="forward"):
        replica.advance_clock(50)


def test_a_blend_with_a_believed_partner_at_the_edge_of_reach_takes_its_clock_within_the_run() -> None:
    """node/outer_step.py: after a blend with a partner whose phase ended --max-staleness (2) outer steps ahead, the
    node's next phase ends one outer step behind the partner's next (whole phases skipped): it stays in reach. Not
    after a blend with a partner one step ahead, level or behind, or one this node does not believe, nor when the
    move would leave the run no phase."""
    from types import SimpleNamespace

    from noloco_node.node.outer_step import OuterStep

    replica = make_replica(inner_steps=10)  # 100 steps: outer steps 1-10
    train(replica, 10)  # the end of the first phase: the blend that ends outer step 0 decides the next phase
    deps = SimpleNamespace(
        replica=replica, max_staleness=2, data_parallel=None, believe=lambda peer_id: peer_id != "stranger"
    )
    step = OuterStep(cast(Any, deps))

    def partner(peer_id: str, outer_step: int) -> Any:
        return SimpleNamespace(peer_id=peer_id, outer_step=outer_step)

    assert step._partners_clock(partner("ahead", 2), 1) == 2  # its next phase ends outer step 2: 10 steps skipped
    assert step._partners_clock(partner("ahead", 9), 1) == 9
    assert step._partners_clock(partner("one ahead", 1), 1) is None  # a staggered swarm's normal pair
    assert step._partners_clock(partner("level", 0), 1) is None
    assert step._partners_clock(partner("stranger", 2), 1) is None
    assert step._partners_clock(None, 1) is None  # a solo step, or a blend refused by the loss check
    assert step._partners_clock(partner("ahead", 2), None) is None  # no further phase: the run is done
    assert step._partners_clock(partner("ahead", 10), 1) is None  # skipping to outer step 10 would end the run
    deps.max_staleness = 3
    assert step._partners_clock(partner("two ahead", 2), 1) is None and step._partners_clock(partner("x", 3), 1) == 2


def test_a_downloaded_state_that_goes_bad_in_its_first_phase_is_rolled_back_and_its_donor_refused(
    tmp_path: Path,
) -> None:
    """node/probation.py: after the first phase on a donor's weights, a validation loss far above the one
    they measured before adoption sends a member back to its own checkpoint and a joiner back to the seed; the
    donor goes on the list never asked again. A state that holds up is kept."""
    from noloco_node.node.probation import PROBATION_MARGIN, Probation

    member = make_replica(seed=0)
    train(member, 10)
    checkpoint = tmp_path / "checkpoint.pt"
    save_checkpoint(checkpoint, {"replica": member.state_dict()})
    own = [p.detach().clone() for p in member.params]
    donor = make_replica(seed=1)
    train(donor, 20)
    donated = {f"phi/{n}": p.detach().clone() for n, p in zip(donor.names, donor.params, strict=True)}
    member.adopt_donor_weights(donated, 3, 30)
    refused: set[str] = set()
    probation = Probation(checkpoint, refused)
    probation.begin("good", 2.0, far_mark=0)
    held_up = 2.0 * (1 + PROBATION_MARGIN)
    assert probation.pending and not probation.judge(member, held_up, True, lambda _mark: 0)  # kept
    assert not probation.pending and member.outer_step == 3 and refused == set()
    probation.begin("poisoner", 2.0, far_mark=0)
    assert probation.judge(member, float("nan"), False, lambda _mark: 0)
    assert refused == {"poisoner"} and (member.outer_step, member.inner_step) == (0, 10)
    assert all(torch.equal(p, o) for p, o in zip(member.params, own, strict=True))  # its own checkpoint again
    joiner = make_replica(seed=0)
    seed = [p.detach().clone() for p in joiner.params]
    joiner.adopt_donor_weights(donated, 3, 30)
    train(joiner, 2)
    fresh = Probation(tmp_path / "none.pt", refused)
    fresh.begin("poisoner2", 2.0, far_mark=0)
    assert fresh.judge(joiner, 9.0, False, lambda _mark: 0)
    assert (joiner.outer_step, joiner.inner_step) == (0, 0) and joiner.optimizer.state == {}
    assert all(torch.equal(p, s) and not d.any() for p, s, d in zip(joiner.params, seed, joiner.delta, strict=True))
    assert refused == {"poisoner", "poisoner2"}


def test_a_downloaded_state_that_blends_with_nobody_while_it_finds_partners_too_far_is_rolled_back(
    tmp_path: Path,
) -> None:
    """node/probation.py: a state that measured well and held up, but whose node blended with nobody in its first
    PROBATION_PHASES phases while it refused FAR_GROUPS network groups under the norm bound since the state was
    adopted (the drifted state of a donor that every member refused), is rolled back and its donor refused.
    Without those refusals (nobody was there to blend with), or with refusals from fewer groups (one host's free
    keys), it is kept, and so is one that blends once."""
    from noloco_node.node.probation import FAR_GROUPS, PROBATION_PHASES, Probation

    refused: set[str] = set()
    joiner = make_replica(seed=0)
    seed = [p.detach().clone() for p in joiner.params]
    donated = {f"phi/{n}": p.detach().clone() + 0.1 for n, p in zip(joiner.names, joiner.params, strict=True)}

    def judged(groups: int, blend_at: int | None) -> list[bool]:
        joiner.adopt_donor_weights(donated, 3, 30)
        probation = Probation(tmp_path / "none.pt", refused)
        probation.begin("drifted", 2.0, far_mark=5)
        asked: list[int] = []

        def far_groups_since(mark: int) -> int:
            asked.append(mark)
            return groups

        verdicts = [
            probation.judge(joiner, 2.0, phase == blend_at, far_groups_since)
            for phase in range(1, PROBATION_PHASES + 2)
        ]
        assert set(asked) <= {5}  # counted from the adoption's mark
        return verdicts

    kept = [False] * (PROBATION_PHASES + 1)
    assert judged(0, None) == kept and refused == set()  # alone: kept
    assert judged(FAR_GROUPS - 1, None) == kept and refused == set()  # one group's keys condemn nothing
    assert judged(FAR_GROUPS, 3) == kept and refused == set()  # it blended: kept
    verdicts = judged(FAR_GROUPS, None)
    assert verdicts == [False] * (PROBATION_PHASES - 1) + [True, False] and refused == {"drifted"}
    assert all(torch.equal(p, s) for p, s in zip(joiner.params, seed, strict=True))  # the seed again


def test_a_node_waiting_for_peers_starts_only_once_the_peers_it_sees_see_as_many() -> None:
    """Two nodes that saw a third at once must not start while the third, its discovery seconds slower, sees
    nobody: each waiting node's record says how many others it sees, and a peer counts once it sees as many (or
    trains). Records without the field (a peer that trains, or an older node) count at once."""
    import asyncio
    from types import SimpleNamespace

    from noloco_node.discovery.dht import PeerRecord
    from noloco_node.node.trainer import Trainer

    def peer(name: str, starting_with: int) -> PeerRecord:
        return PeerRecord(name, f"127.0.0.1:{7000 + len(name)}", "run", starting_with=starting_with)

    # What this node's lookups find, one answer a lookup: the third node first sees nobody, then sees both.
    answers = [
        [peer("b", 1), peer("c", 0)],
        [peer("b", 2), peer("c", 0), peer("d", 0)],  # a view that churns: more than it waits for, then fewer
        [peer("b", 2), peer("c", 0)],
        [peer("b", 2), peer("c", 2)],
    ]
    lookups: list[int] = []
    published: list[int] = []

    async def live_peers() -> list[PeerRecord]:
        lookups.append(len(lookups))
        return answers[min(len(lookups) - 1, len(answers) - 1)]

    waiting = SimpleNamespace(
        cfg=SimpleNamespace(wait_for_peers=2, wait_for_peers_timeout=60.0),
        telemetry=SimpleNamespace(phase=""),
        discovery=SimpleNamespace(live_peers=live_peers),
        starting_with=0,
    )

    async def publish_record() -> None:
        published.append(waiting.starting_with)

    waiting.publish_record = publish_record
    asyncio.run(Trainer.wait_for_peers(cast(Any, waiting), asyncio.Event()))
    assert len(lookups) == 4  # it waited for the third to see the others, not only for the others to be there
    assert published == [2]  # its record said once that it sees enough; the view's churn republished nothing
    assert waiting.starting_with == -1  # training now: its next record counts for any peer still waiting

    # A peer already training (no count in its record) is one to start with at once.
    answers[:] = [[peer("b", -1), peer("c", -1)]]
    lookups.clear()
    waiting.starting_with = 0
    asyncio.run(Trainer.wait_for_peers(cast(Any, waiting), asyncio.Event()))
    assert len(lookups) == 1
