"""security/caller_proof.py: a proof is good once, and no flood of fresh proofs makes an unexpired one good again."""

from __future__ import annotations

import pytest

from noloco_node.security import caller_proof
from noloco_node.security.caller_proof import CallerProofError, CallerVerifier, prove
from noloco_node.security.identity import NodeIdentity

SERVER, CALLER = NodeIdentity.ephemeral(), NodeIdentity.ephemeral()
METHOD = "/noloco.v1.Peer/Exchange"


def test_a_replay_after_a_flood_of_fresh_proofs_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(caller_proof, "MAX_REMEMBERED_NONCES", 8)
    verifier = CallerVerifier(SERVER.peer_id)
    used = prove(CALLER, METHOD, SERVER.peer_id)
    assert verifier.verify(METHOD, used) == CALLER.peer_id
    flood = 0
    with pytest.raises(CallerProofError) as full:  # fresh valid proofs until the table has no room
        while flood < 100:
            verifier.verify(METHOD, prove(CALLER, METHOD, SERVER.peer_id))
            flood += 1
    assert full.value.reason == "busy" and flood == 7  # refused, not a remembered nonce forgotten
    with pytest.raises(CallerProofError) as replay:
        verifier.verify(METHOD, used)
    assert replay.value.reason == "replayed_proof"


def test_expired_nonces_make_room_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(caller_proof, "MAX_REMEMBERED_NONCES", 2)
    clock = [1000.0]
    monkeypatch.setattr(caller_proof.time, "monotonic", lambda: clock[0])
    verifier = CallerVerifier(SERVER.peer_id, max_clock_skew=60.0)
    for _ in range(2):
        verifier.verify(METHOD, prove(CALLER, METHOD, SERVER.peer_id))
    with pytest.raises(CallerProofError, match="try again"):
        verifier.verify(METHOD, prove(CALLER, METHOD, SERVER.peer_id))
    clock[0] += 121.0  # past twice the skew: those proofs fail the clock check anyway, their nonces can go
    assert verifier.verify(METHOD, prove(CALLER, METHOD, SERVER.peer_id)) == CALLER.peer_id
