"""peer_policy.py: deadlines learnt from observed exchanges, and backoff for peers that keep failing."""

from __future__ import annotations

import pytest

from noloco_node.pairing.peer_policy import PeerPolicy


def policy() -> PeerPolicy:
    return PeerPolicy(exchange_timeout=60.0, min_deadline=5.0, avoid_seconds=10.0)


def test_deadlines_follow_observed_timings_between_floor_and_ceiling() -> None:
    rules = policy()
    assert rules.deadline("a") == 60.0  # nothing known: the configured ceiling
    rules.succeeded("a", 0.1)
    assert rules.deadline("a") == 5.0  # fast exchanges: the floor, never less
    assert rules.deadline("b") == 5.0  # an unknown peer gets what peers in general take
    for _ in range(20):
        rules.succeeded("slow", 8.0)
    assert rules.deadline("slow") == pytest.approx(4 * 8.0 + 2.0)
    for _ in range(20):
        rules.succeeded("slower", 30.0)
    assert rules.deadline("slower") == 60.0  # capped by exchange_timeout


def test_failing_peers_are_avoided_longer_each_time_and_forgiven_by_a_success() -> None:
    rules = policy()
    assert [rules.failed("a") for _ in range(8)] == [10, 20, 40, 80, 160, 320, 320, 320]
    assert rules.avoided("a") and not rules.avoided("b")
    rules.succeeded("a", 1.0)
    assert not rules.avoided("a") and rules.failed("a") == 10


def test_peers_that_left_are_forgotten_unless_still_avoided() -> None:
    rules = policy()
    rules.succeeded("gone", 1.0)
    rules.failed("bad")
    rules.forget(set())
    assert "gone" not in rules._peers and "bad" in rules._peers


def test_a_peer_that_answers_again_after_a_silence_is_called_again_at_once_unless_avoided_for_its_payloads() -> None:
    rules = policy()
    for _ in range(6):
        rules.failed("partitioned")  # avoided 320 s: a minute of failed calls during a partition
    assert rules.avoided("partitioned")
    assert rules.answered_again("partitioned")  # the path is whole again
    assert not rules.avoided("partitioned")
    # Still broken after all: the backoff goes on from where it was, and a peer going quiet and answering again
    # cannot have itself called after every failure (once per LIFT_EVERY_AVOIDS * avoid_seconds).
    assert rules.failed("partitioned") == 320
    assert not rules.answered_again("partitioned") and rules.avoided("partitioned")
    rules.succeeded("partitioned", 1.0)  # a call that worked clears the record
    assert rules.failed("partitioned") == 10
    # ... and earns the lift back: a peer that restarts right after a heal (its calls failing while it is down)
    # is called again as soon as it answers, not after its avoidance (seen: 80 s alone in bench outsider).
    assert rules.answered_again("partitioned") and not rules.avoided("partitioned")

    rules.failed("drifted", "norm_bound")  # set aside for drift: about its weights, not the path
    rules.quarantine("liar", 600.0, "bad_checksum")
    assert not rules.answered_again("drifted") and rules.avoided("drifted")
    assert not rules.answered_again("liar") and rules.avoided("liar")
    assert not rules.answered_again("never-seen")
