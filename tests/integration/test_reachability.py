"""A node that peers cannot reach (behind NAT, port not forwarded) says what to open, advertises itself as
unreachable, holds a reachable peer as its relay, and pairs both ways: by calling, and by being called through the
relay (discovery/tunnels.py). test_nat.py does the same behind real NATs."""

from __future__ import annotations

from pathlib import Path

from .swarm_harness import Bootstrap, NodeProcess
from .throttling_proxy import free_port

TRAIN = ["--model", "tiny", "--seq-len", "64", "--batch-size", "8", "--eval-batches", "2"]


def test_an_unreachable_node_is_called_through_its_relay_and_blends_both_ways(
    bootstrap: Bootstrap, tmp_path: Path
) -> None:
    common = [*TRAIN, "--steps", "240", "--inner-steps", "20", "--pair-timeout", "5", "--record-ttl", "6"]
    closed_port = str(free_port())  # announced, but nothing listens there: like a port nobody forwarded
    hidden = NodeProcess("hidden", bootstrap, tmp_path, *common, "--shard-index", "0", "--announce-port", closed_port)
    open_node = NodeProcess("open", bootstrap, tmp_path, *common, "--shard-index", "1")
    try:
        assert hidden.wait(timeout=300) == 0 and open_node.wait(timeout=300) == 0, hidden.output()[-3000:]
        log = hidden.output()
        assert "peers cannot reach this node at " in log and f"open TCP port {closed_port}" in log
        hidden_status, open_status = hidden.status(), open_node.status()
        assert hidden_status is not None and open_status is not None
        assert hidden_status["reachable"] is False and open_status["reachable"] is True
        # The one reachable peer is its relay. Read from its log, not its last status: the open node may stop first,
        # and a relay that stopped is dropped at the next refresh.
        held = {
            line.split("relays ", 1)[1] for line in log.splitlines() if "unreachable: reached through relays " in line
        }
        assert len(held - {"(none yet)"}) == 1 and "," not in "".join(held), held
        hidden_id = hidden_status["peer_id"]
        blends = [h for h in hidden_status["history"] if h["partner"] == open_status["peer_id"]]
        assert blends, "the unreachable node never blended"
        # The open node called it too, through the tunnel (it is its relay: no third party in between).
        assert hidden_status["tunnels_served"] > 0 and open_status["tunnels_opened"] > 0
        assert any(e["role"] == "served" for e in hidden_status["exchanges"])
        assert any(e["role"] == "caller" for e in open_status["exchanges"] if e["peer"] == hidden_id)
    finally:
        hidden.stop()
        open_node.stop()
