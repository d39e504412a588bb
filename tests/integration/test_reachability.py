"""A node that peers cannot reach (behind NAT, port not forwarded) says what to open, advertises itself as
unreachable, is never called, and still pairs by calling the reachable peers."""

from __future__ import annotations

from pathlib import Path

from .swarm_harness import Bootstrap, NodeProcess
from .throttling_proxy import free_port

TRAIN = ["--model", "tiny", "--seq-len", "64", "--batch-size", "8", "--eval-batches", "2"]


def test_an_unreachable_node_only_calls_out_and_still_blends(bootstrap: Bootstrap, tmp_path: Path) -> None:
    common = [*TRAIN, "--steps", "240", "--inner-steps", "20", "--pair-timeout", "5"]
    closed_port = str(free_port())  # announced, but nothing listens there: like a port nobody forwarded
    hidden = NodeProcess("hidden", bootstrap, tmp_path, *common, "--shard-index", "0", "--announce-port", closed_port)
    open_node = NodeProcess("open", bootstrap, tmp_path, *common, "--shard-index", "1")
    try:
        assert hidden.wait(timeout=300) == 0 and open_node.wait(timeout=300) == 0, hidden.output()[-3000:]
        log = hidden.output()
        assert "peers cannot reach this node at " in log and f"Open TCP port {closed_port}" in log
        hidden_status, open_status = hidden.status(), open_node.status()
        assert hidden_status is not None and open_status is not None
        assert hidden_status["reachable"] is False and open_status["reachable"] is True
        hidden_id = hidden_status["peer_id"]
        blends = [h for h in hidden_status["history"] if h["partner"] == open_status["peer_id"]]
        assert blends, "the unreachable node never blended"
        # Every exchange between them was the hidden node calling: the open node never dialled it.
        assert all(e["role"] == "caller" for e in hidden_status["exchanges"])
        assert all(e["role"] == "served" for e in open_status["exchanges"] if e["peer"] == hidden_id)
    finally:
        hidden.stop()
        open_node.stop()
