"""Rollouts as they are shared (rl/rollouts.py) and the tasks behind them (rl/tasks.py): a batch is taken whole or
refused with its reason; the pool hands each group out once, freshest first, spread over peers, never a stale one;
the book serves a node's last rounds; and every receiver regenerates a task from its reference and scores it."""

from __future__ import annotations

import threading
import time

import pytest

from noloco_node.rl.rollouts import (
    MAX_COMPLETION_CHARS,
    MAX_GROUPS,
    ROUNDS_SERVED,
    ExternalPool,
    RolloutBook,
    RolloutError,
    SharedGroup,
    decode_batch,
    encode_batch,
)
from noloco_node.rl.tasks import TaskError, TaskRef, TaskSampler, check_families, regenerate, score

REF = TaskRef("chain_sum", 3, 11)


def _batch(**changes: object) -> object:
    groups = [SharedGroup(REF, ("1", "2", "3", "4"))]
    batch = encode_batch("run", "peer", 7, groups)
    for key, value in changes.items():
        setattr(batch, key, value)
    return batch


def test_a_well_formed_batch_is_decoded_with_its_sender_and_round():
    groups = decode_batch(_batch(), run_fingerprint="run", peer_id="peer", round_=7)
    assert groups == [SharedGroup(REF, ("1", "2", "3", "4"), "peer", 7)]


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda b: setattr(b, "run_fingerprint", "other"), "run"),
        (lambda b: setattr(b, "peer_id", "someone"), "peer"),
        (lambda b: setattr(b, "round", 8), "round"),
        (lambda b: b.groups.extend([b.groups[0]] * MAX_GROUPS), "too_many_groups"),
        (lambda b: setattr(b.groups[0], "family", "no_such_family"), "unknown_family"),
        (lambda b: setattr(b.groups[0], "index", 10**9), "task_range"),
        (lambda b: b.groups[0].completions.__delitem__(slice(1, None)), "group_size"),
        (lambda b: b.groups[0].completions.append("x" * (MAX_COMPLETION_CHARS + 1)), "completion_too_long"),
    ],
)
def test_a_malformed_batch_is_refused_whole_with_its_reason(mutate, reason):
    batch = _batch()
    batch.groups.append(batch.groups[0])  # a good group beside the bad one is not taken either
    mutate(batch)
    with pytest.raises(RolloutError) as refused:
        decode_batch(batch, run_fingerprint="run", peer_id="peer", round_=7)
    assert refused.value.reason == reason


def test_the_pool_hands_out_each_group_once_freshest_first_spread_over_peers():
    pool = ExternalPool(max_age=60)
    a = [SharedGroup(TaskRef("chain_sum", 1, i), ("x", "y"), "a", 1) for i in range(4)]
    b = [SharedGroup(TaskRef("chain_sum", 2, i), ("x", "y"), "b", 1) for i in range(2)]
    pool.add(a, now=0.0)
    pool.add(b, now=1.0)
    taken = pool.take(4, now=2.0)
    assert {g.peer_id for g in taken} == {"a", "b"} and len(taken) == 4
    assert taken[0] == b[-1]  # the freshest first
    rest = pool.take(10, now=2.0)
    assert len(rest) == 2 and not set(rest) & set(taken)
    assert pool.take(1, now=2.0) == []


def test_stale_groups_are_dropped_unused_and_counted():
    pool = ExternalPool(max_age=10)
    pool.add([SharedGroup(REF, ("x", "y"), "a", 1)], now=0.0)
    assert pool.take(1, now=11.0) == [] and pool.stale == 1


def test_waiting_for_rollouts_ends_on_arrival_timeout_or_stop():
    pool, stop = ExternalPool(max_age=60), threading.Event()
    started = time.monotonic()
    pool.wait_for(1, 0.3, stop)
    assert 0.25 < time.monotonic() - started < 2.0
    threading.Timer(0.1, lambda: pool.add([SharedGroup(REF, ("x", "y"), "a", 1)])).start()
    started = time.monotonic()
    pool.wait_for(1, 10.0, stop)
    assert time.monotonic() - started < 5.0 and len(pool) == 1
    stop.set()
    started = time.monotonic()
    pool.wait_for(5, 10.0, stop)
    assert time.monotonic() - started < 1.0


def test_the_book_serves_the_last_rounds_and_counts_what_it_served():
    book = RolloutBook("run", "peer")
    for round_ in range(1, ROUNDS_SERVED + 3):
        book.publish(round_, [SharedGroup(REF, ("a", "b"))])
    assert book.latest_round == ROUNDS_SERVED + 2
    assert book.batch(1) is None  # stale
    served = book.batch(ROUNDS_SERVED + 2)
    assert served is not None and served.round == ROUNDS_SERVED + 2 and served.peer_id == "peer"
    assert book.served_batches == 1 and book.served_groups == 1


def test_a_task_is_regenerated_from_its_reference_and_scored_by_its_verifier():
    task = regenerate(REF)
    assert task == regenerate(REF)  # every node regenerates the same question and answer
    assert score(task, task.answer) == 1.0
    assert score(task, f"{task.answer}\nanything after the first line") == 1.0
    assert score(task, "not a number") == 0.0
    with pytest.raises(TaskError, match="unknown task family"):
        regenerate(TaskRef("no_such_family", 1, 1))
    with pytest.raises(TaskError, match="unknown task family"):
        check_families(["chain_sum", "nope"])
    drawn = TaskSampler(["chain_sum", "spell_backward"], seed=4).draw(4)
    assert [t.ref.family for t in drawn] == ["chain_sum", "spell_backward"] * 2
    assert [t.ref for t in drawn] == [t.ref for t in TaskSampler(["chain_sum", "spell_backward"], seed=4).draw(4)]
