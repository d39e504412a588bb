"""The norm bound, rate-limited complaints, quarantine, the watchdog's verdicts and config hardening."""

from __future__ import annotations

import logging
import math
import time

import pytest
import torch
from pydantic import ValidationError

from noloco_node.config.models import TrainConfig, format_validation_error
from noloco_node.config.node_config import NodeConfig, SecurityConfig
from noloco_node.config.settings import SettingsError, env_layer
from noloco_node.node.outer_step import phase_learning_rates
from noloco_node.pairing.peer_policy import PeerPolicy
from noloco_node.rpc.transport import GuardedCall, Watchdog
from noloco_node.security.payload_guard import Complaints, NormGuard, relative_distance, relative_distances
from noloco_node.training.replica import learning_rate
from noloco_node.wire import sparse
from noloco_node.wire.frames import PayloadError


def test_relative_distance_is_exact_and_slices_big_tensors() -> None:
    own = [torch.randn(3, 5), torch.randn(3_000_000)]  # the second spans three slices
    theirs = [t + 0.1 * torch.randn_like(t) for t in own]
    expected = math.sqrt(sum(float(((a - b) ** 2).sum()) for a, b in zip(theirs, own, strict=True))) / math.sqrt(
        sum(float((b**2).sum()) for b in own)
    )
    assert relative_distance(theirs, own) == pytest.approx(expected, rel=1e-5)
    assert relative_distance([t.to(torch.bfloat16) for t in own], own) < 0.01


def test_the_bound_follows_the_nodes_own_movement_and_no_payload_widens_it() -> None:
    guard = NormGuard(factor=3.0, window=4)
    with pytest.raises(PayloadError) as not_ready:  # no phase of its own yet: no judgement, and no blame
        guard.admit(0.01, "p")
    assert not_ready.value.reason == "not_ready" and not not_ready.value.blames_sender
    assert guard.bound() is None and guard.basis == "none_yet"
    guard.observe_own_movement(0.1, phase_lr=1e-3, partner_lr=1e-3)
    assert guard.bound() == pytest.approx(0.3) and guard.basis == "own_movement"
    for _ in range(50):  # the ratchet: payloads just inside the bound, over and over
        guard.admit(0.29, "attacker")
    assert guard.bound() == pytest.approx(0.3)
    with pytest.raises(PayloadError) as refused:
        guard.admit(1.4, "attacker")  # random weights
    assert refused.value.reason == "norm_bound" and "1.4" in refused.value.message and refused.value.blames_sender
    for movement in (0.05, 0.04, 0.03, 0.02):  # the largest of the last `window` phases
        guard.observe_own_movement(movement, phase_lr=1e-3, partner_lr=1e-3)
    assert guard.bound() == pytest.approx(0.15)
    with pytest.raises(PayloadError):
        guard.admit(float("nan"), "p")
    restarted = NormGuard(factor=3.0)
    restarted.restore([(0.05, 1e-3, 1e-3), (float("nan"), 1e-3, 1e-3), (0.02, 1e-3, 1e-3)])  # the checkpoint's
    assert restarted.bound() == pytest.approx(0.15)
    assert NormGuard(fixed=0.05).bound() == 0.05 and NormGuard(fixed=0.05).basis == "fixed"
    early = NormGuard(factor=3.0)
    early.observe_own_movement(0.46, phase_lr=1e-3, partner_lr=1e-3)  # a tiny model's second phase moves this much
    assert early.bound() == pytest.approx(0.9)  # weights at zero (distance 1.0) are refused all the same


def test_a_phase_under_half_of_h_does_not_move_the_bound_once_there_is_one() -> None:
    """The run's last phase may be one step long: one step's movement scaled to H is a noisy guess, and the bound
    takes the largest movement of its window, so such a phase is left out (the first phase counts whatever its
    length: a node needs a bound)."""
    first = NormGuard(factor=3.0)
    assert first.observe_phase(0.002, steps=2, inner_steps=20, phase_lr=1e-3, partner_lr=1e-3) == pytest.approx(0.02)
    assert first.bound() == pytest.approx(0.06)  # a run whose first phase is short still gets a bound
    guard = NormGuard(factor=3.0)
    assert guard.observe_phase(0.01, steps=20, inner_steps=20, phase_lr=1e-3, partner_lr=1e-3) == pytest.approx(0.01)
    assert guard.observe_phase(0.004, steps=10, inner_steps=20, phase_lr=1e-3, partner_lr=1e-3) == pytest.approx(0.008)
    assert guard.bound() == pytest.approx(0.03)
    assert guard.observe_phase(0.003, steps=1, inner_steps=20, phase_lr=1e-3, partner_lr=1e-3) is None  # 0.06 scaled
    assert guard.bound() == pytest.approx(0.03)


def test_in_the_warmup_a_partner_further_along_is_allowed_its_larger_learning_rate() -> None:
    """Seen in a 3-node swarm with a 10,000-step warmup: a partner one phase ahead was 0.00086 away, this node's own
    movement allowed 0.00062, and every partner was quarantined. Movement scales with the learning rate."""
    cfg = TrainConfig(total_steps=100_000, inner_steps=10, lr=3e-3)
    phase_lr, partner_lr = phase_learning_rates(cfg, inner_step=20, max_staleness=2)
    assert partner_lr == pytest.approx(learning_rate(50, cfg)) and partner_lr > 2 * phase_lr
    guard = NormGuard(factor=3.0)
    guard.observe_own_movement(0.0002, phase_lr, partner_lr)
    guard.admit(0.00086, "a partner two phases ahead")
    late_lr, late_partner = phase_learning_rates(cfg, inner_step=90_000, max_staleness=2)
    assert late_partner == pytest.approx(learning_rate(90_000 - 30, cfg))  # in the decay, one behind moves more
    assert late_partner >= late_lr


def test_as_the_learning_rate_falls_the_bound_keeps_the_movement_of_its_window() -> None:
    """The spread between replicas shrinks with their blends, not with the learning rate: in a 32-member swarm of
    tiny models over a 300-step cosine decay, honest partners were 0.12-0.34 from each other at outer steps 10-14,
    while a bound scaled to the falling rate had come down to 0.10-0.21 (40 payloads refused, solo steps in turn).
    The movements below are node0's of that run, per phase, with the rates it trained at."""
    phases = [  # (movement, phase_lr, partner_lr), outer steps 5-13
        (0.133, 0.00268, 0.00299),
        (0.111, 0.00245, 0.00292),
        (0.094, 0.00218, 0.00278),
        (0.080, 0.00185, 0.00258),
        (0.072, 0.00154, 0.00233),
        (0.063, 0.00123, 0.00204),
        (0.048, 0.00098, 0.00173),
        (0.037, 0.00073, 0.00142),
        (0.029, 0.00052, 0.00112),
    ]
    guard = NormGuard(factor=3.0, window=8)
    for movement, phase_lr, partner_lr in phases:
        guard.observe_own_movement(movement, phase_lr, partner_lr, per_tensor=[movement, 2 * movement])
    followed_the_rate = 3.0 * max(m / lr for m, lr, _ in phases[1:]) * phases[-1][2]
    assert followed_the_rate == pytest.approx(0.19, abs=0.01)
    assert guard.bound() == pytest.approx(3.0 * 0.111)  # the window's largest movement, outer step 6's
    guard.admit(0.32, "an honest partner built apart while the rate was high")
    with pytest.raises(PayloadError):
        guard.admit(0.34, "beyond even that")
    # Each tensor alike: its own largest movement of the window, as it was.
    assert guard.tensor_bounds(0.0) == pytest.approx([3.0 * 3.0 * 0.111, 3.0 * 3.0 * 0.222])


def test_a_sparse_runs_code_is_held_by_the_movement_bound_it_never_exceeds() -> None:
    """A sparse run's progress is the top-k code of one phase's progress (no error feedback): smaller than the
    progress, whatever its direction, so the bound a phase's movement sets admits an honest partner's, and a code
    scaled past the factor is refused like any far payload."""
    torch.manual_seed(0)
    size = 1 << 16
    phi = torch.randn(size) * 20
    guard = NormGuard(factor=3.0)
    for progress in (torch.randn(size), torch.randn(size).pow(3), torch.randn(size) * (torch.rand(size) < 0.01)):
        code = sparse.decode(sparse.encode(progress), size)
        movement = float(progress.norm()) / float(phi.norm())
        sent = float(code.norm()) / float(phi.norm())
        assert 0 < sent <= movement, (sent, movement)
        guard.observe_own_movement(movement, phase_lr=1.0, partner_lr=1.0)
        guard.admit(sent, "an honest partner")
    with pytest.raises(PayloadError):
        guard.admit(3.5 * max(guard._per_lr), "a partner whose code is 3.5 phases' movement")


def _tiny_model_phase() -> tuple[list[str], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """The tiny model's named weights (phi), and two honest phases from them: each matrix moves by 2% of its norm,
    the normalisations' weights by 0.5% and the embedding by 10% (more than the whole), in a direction the two
    replicas half share."""
    from noloco_node.config.models import model_config_for
    from noloco_node.model.decoder import LlamaDecoder, named_parameters_ordered

    torch.manual_seed(0)
    model = LlamaDecoder(model_config_for("tiny", vocab_size=256, max_seq_len=64))
    names, phi = zip(*[(name, p.detach().clone()) for name, p in named_parameters_ordered(model)], strict=True)
    shared = [torch.randn_like(t) for t in phi]

    def phase() -> list[torch.Tensor]:
        moved = []
        for name, t, g in zip(names, phi, shared, strict=True):
            direction = (g + torch.randn_like(t)) / 2
            share = 0.005 if "norm" in name else 0.1 if "embed" in name else 0.02
            moved.append(t + share * float(t.norm()) * direction / float(direction.norm()))
        return moved

    return list(names), list(phi), phase(), phase()


def test_a_payload_that_spends_the_whole_allowance_on_one_tensor_is_refused_by_that_tensors_bound() -> None:
    """The overall distance alone lets a payload spend the model's whole allowance on one tensor: 0.8 of the bound
    spent on the tiny model's smallest tensor (an attention output projection, about 3% of the model's norm) moves
    it by about 25 times the bound. Each tensor is held to its own bound: three times the larger of the overall one
    and three times that tensor's own movement (where it moves more than the whole, as an honest partner's does)."""
    names, phi, own_theta, partner_theta = _tiny_model_phase()
    guard = NormGuard(factor=3.0)
    movement, per_tensor = relative_distances(own_theta, phi)
    guard.observe_phase(movement, 20, 20, phase_lr=1e-3, partner_lr=1e-3, per_tensor=per_tensor)
    bound = guard.bound()
    assert bound is not None
    honest, honest_tensors = relative_distances(partner_theta, phi)
    guard.admit(honest, "honest", tensors=list(zip(names, honest_tensors, strict=True)))
    assert guard.last_tensor_ratio is not None and guard.last_tensor_ratio < 0.7
    # The embedding moves more than the whole, relative to its own norm: its own movement bounds it.
    assert max(honest_tensors) > bound
    norms = [float(t.norm()) for t in phi]
    smallest = norms.index(min(norms))
    assert "o_proj" in names[smallest]
    hostile = [t.clone() for t in partner_theta]
    hostile[smallest] = phi[smallest] * (1 - 0.8 * bound * math.sqrt(sum(n * n for n in norms)) / norms[smallest])
    distance, tensors = relative_distances(hostile, phi)
    assert distance < bound  # the overall check alone admits it
    with pytest.raises(PayloadError) as refused:
        guard.admit(distance, "hostile", tensors=list(zip(names, tensors, strict=True)))
    assert refused.value.reason == "norm_bound" and f"{names[smallest]} from hostile is " in refused.value.message
    assert guard.last_distance == honest  # nothing learnt from the refused one
    # Widened for drift like the whole, and absent before a phase was measured tensor by tensor (a restart's first).
    unwidened = guard.tensor_bounds(0.0)
    assert unwidened is not None
    assert guard.tensor_bounds(0.1, widen=2.0) == pytest.approx([max(3 * 0.1, 2 * b) for b in unwidened])
    restarted = NormGuard(factor=3.0)
    restarted.restore([(movement, 1e-3, 1e-3)])
    assert restarted.tensor_bounds(bound) is None
    restarted.admit(distance, "hostile", tensors=list(zip(names, tensors, strict=True)))  # the overall check only


def test_complaints_are_logged_once_per_peer_and_reason_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    complaints = Complaints(interval=0.2, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING):
        assert complaints.complain("a", "norm_bound", "far")
        assert not complaints.complain("a", "norm_bound", "far")
        assert complaints.complain("a", "checksum", "bad")
        assert complaints.complain("b", "norm_bound", "far")
        now[0] += 0.25  # past the interval
        assert complaints.complain("a", "norm_bound", "far")
    assert len(caplog.records) == 4 and "1 more since the last report" in caplog.records[-1].getMessage()


def test_a_quarantine_outlives_a_success_and_ends() -> None:
    now = [0.0]
    policy = PeerPolicy(exchange_timeout=10, min_deadline=1, avoid_seconds=1, clock=lambda: now[0])
    policy.quarantine("p", 0.2, "bad_seal")
    policy.quarantine("q", 0.1, "norm_bound")
    policy.succeeded("p", 0.1)
    assert policy.quarantined("p") and policy.avoided("p")
    assert policy.quarantined_now(1) == {"p": "bad_seal"}  # what the status lists: the reasons, bounded
    policy.forget(set())  # a quarantined peer that left is remembered until the quarantine ends
    assert policy.quarantined("p")
    now[0] += 0.25  # past the quarantine
    assert not policy.quarantined("p") and not policy.avoided("p") and policy.quarantined_now(10) == {}


def test_the_watchdog_cuts_calls_past_their_limit_or_below_the_minimum_rate() -> None:
    now = time.monotonic()

    def call(moved: int, *, limit: float = 100, transferred: bool = False) -> GuardedCall:
        guarded = GuardedCall(None, now + limit, lambda: moved, min_rate=1000.0, grace=5.0, started=now - 10)  # type: ignore[arg-type]
        guarded.transferred = transferred
        return guarded

    assert Watchdog._verdict(call(10_000), now) is None  # 10 s in: 5 s past the grace needs 5000 bytes
    assert Watchdog._verdict(call(4_000), now) == "too_slow"
    assert Watchdog._verdict(call(4_000, transferred=True), now) is None  # all moved: only the limit applies
    assert Watchdog._verdict(call(10**9, limit=-1), now) == "deadline"


def test_unknown_keys_and_variables_are_named_and_secrets_are_not_echoed() -> None:
    with pytest.raises(ValidationError) as bad:
        NodeConfig(security={"secret_file": 5, "tls_ca": "ca.pem"})
    message = format_validation_error(bad.value)
    assert "security" in message and "(got {" not in message
    with pytest.raises(ValidationError) as unknown:
        SecurityConfig(swarm_secret="hunter2-hunter2-hunter2")
    message = format_validation_error(unknown.value)
    assert "swarm_secret" in message and "hunter2" not in message
    with pytest.raises(ValidationError) as typo:
        NodeConfig(mode="sync", norm_bound=1.0)  # belongs in security
    assert "norm_bound" in format_validation_error(typo.value)
    with pytest.raises(SettingsError, match="NOLOCO_SWARM_SECRT") as typo_env:
        env_layer({"NOLOCO_CACHE_DIR": "x", "NOLOCO_SWARM_SECRT": "y", "NOLOCO_TRAIN__LR": "0.1", "PATH": "/bin"})
    assert "NOLOCO_CACHE_DIR" not in str(typo_env.value).split(":")[0]


@pytest.mark.parametrize("wire_dtype", ["bf16", "int8"])
def test_the_distance_measured_chunk_by_chunk_is_the_one_measured_after_arrival(wire_dtype: str) -> None:
    """RunningGap sees every chunk as it arrives (bf16) or each tensor once decoded (int8): its distances equal
    relative_distance on the received payload, its reference copy is released once, and a payload it did not see
    whole gets no distance (the node then measures it after arrival)."""
    from noloco_node.security.payload_guard import RunningGap
    from noloco_node.wire.frames import build_manifest, iter_frames, layout_of
    from noloco_node.wire.payload import PayloadReceiver

    phi = [torch.randn(300, 7), torch.randn(70_000)]
    delta = [0.01 * torch.randn_like(t) for t in phi]
    sent = [("theta/a", phi[0] + 0.02 * torch.randn(300, 7)), ("theta/b", phi[1] + 0.02 * torch.randn(70_000))]
    sent += [("delta/a", delta[0] * 3), ("delta/b", delta[1] * 3)]
    references = {"theta/a": phi[0].view(-1), "theta/b": phi[1], "delta/a": delta[0].view(-1), "delta/b": delta[1]}
    released = []
    gap = RunningGap(references, lambda: released.append(1))
    receiver = PayloadReceiver(
        layout_of(sent), run_fingerprint="r", max_total_bytes=10**8, allowed_dtypes=(wire_dtype,), observer=gap
    )
    manifest = build_manifest(sent, wire_dtype=wire_dtype, run_fingerprint="r", peer_id="p", outer_step=1)
    for frame in iter_frames(manifest, [t for _, t in sent], chunk_bytes=4096):
        receiver.feed(frame)
    payload = receiver.finish()
    receiver.release_observer()
    assert released == [1] and payload.observer is gap
    got = [payload.tensors[name] for name, _ in sent]
    measured = gap.distances({"theta": 2100 + 70_000, "delta": 2100 + 70_000})
    assert measured is not None
    assert measured["theta"] == pytest.approx(relative_distance(got[:2], phi), rel=1e-5)
    assert measured["delta"] == pytest.approx(relative_distance(got[2:], delta, phi), rel=1e-5)
    # Tensor by tensor too (the per-tensor check of NormGuard.admit), in the order of the names asked for.
    assert gap.tensor_distances("theta", ["b", "a"]) == pytest.approx(relative_distances(got[:2], phi)[1][::-1])
    assert gap.distances({"theta": 2100 + 70_000, "phi": 10}) is None  # a part it did not see
    gap.observe("theta/a", 0, torch.zeros(5))  # after close: references dropped, nothing measured
    assert gap.seen["theta"] == 2100 + 70_000
