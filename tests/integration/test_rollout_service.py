"""GetRollouts over real gRPC on 127.0.0.1 (rpc/rollout_serving.py): a node's round is served to whoever asks and
every bad request gets its precise status, counted: another run's caller FAILED_PRECONDITION, a round no longer
held NOT_FOUND, garbage INVALID_ARGUMENT, a node that shares no rollouts UNIMPLEMENTED."""

from __future__ import annotations

import grpc
import pytest

from noloco_node.rl.rollouts import ROUNDS_SERVED, RolloutBook, SharedGroup
from noloco_node.rl.served import RolloutPeerNode
from noloco_node.rl.tasks import TaskRef
from noloco_node.rpc.client import fetch_rollouts
from noloco_node.rpc.contracts import GET_ROLLOUTS_METHOD
from noloco_node.rpc.metrics import ExchangeMetrics
from noloco_node.rpc.service import start_server
from noloco_node.rpc.transport import CHANNEL_OPTIONS
from noloco_node.wire import peer_pb2 as pb


@pytest.fixture
def served():
    book = RolloutBook("rl-run", "me")
    for round_ in range(1, ROUNDS_SERVED + 2):
        book.publish(round_, [SharedGroup(TaskRef("chain_sum", 1, round_), ("1", "2"))])
    metrics = ExchangeMetrics()
    node = RolloutPeerNode("rl-run", lambda: "me", lambda: pb.InfoReply(peer_id="me"))
    server, port = start_server(node, metrics, bind="127.0.0.1:0", rollouts=book)
    yield f"127.0.0.1:{port}", metrics, book
    server.stop(grace=0).wait(5)


def test_a_round_is_served_and_bad_requests_get_their_status(served):
    address, metrics, book = served
    batch = fetch_rollouts(address, "rl-run", ROUNDS_SERVED + 1, timeout=5)
    assert batch.round == ROUNDS_SERVED + 1 and batch.peer_id == "me" and len(batch.groups) == 1
    assert book.served_groups == 1
    with pytest.raises(grpc.RpcError) as other_run:
        fetch_rollouts(address, "another-run", ROUNDS_SERVED + 1, timeout=5)
    assert other_run.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as stale:
        fetch_rollouts(address, "rl-run", 1, timeout=5)
    assert stale.value.code() == grpc.StatusCode.NOT_FOUND and "stale" in str(stale.value.details())
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        garbage = channel.unary_unary(GET_ROLLOUTS_METHOD)
        with pytest.raises(grpc.RpcError) as malformed:
            garbage(b"\xff\xff\xff", timeout=5)
    assert malformed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    refused = metrics.rejected
    assert refused["rollouts_run"] == 1 and refused["rollouts_stale"] == 1 and refused["rollouts_malformed"] == 1
    assert book.served_groups == 1  # nothing else was handed out


def test_a_node_that_shares_no_rollouts_answers_unimplemented():
    node = RolloutPeerNode("run", lambda: "me", lambda: pb.InfoReply(peer_id="me"))
    metrics = ExchangeMetrics()
    server, port = start_server(node, metrics, bind="127.0.0.1:0")
    try:
        with pytest.raises(grpc.RpcError) as unshared:
            fetch_rollouts(f"127.0.0.1:{port}", "run", 1, timeout=5)
        assert unshared.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert metrics.rejected["rollouts_not_shared"] == 1
    finally:
        server.stop(grace=0).wait(5)
