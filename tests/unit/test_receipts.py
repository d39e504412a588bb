"""Receipts and the ledger without sockets: both signatures or none, forged, altered, replayed and other-run receipts
refused with their reason, a member counted once per step, closed clusters shown apart, the book's pages."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest

from noloco_node.observability.ledger import build_ledger, format_ledger, read_receipt_files
from noloco_node.security.identity import NodeIdentity
from noloco_node.security.receipts import Receipt, ReceiptBook, ReceiptDraft, ReceiptError, ReceiptTerms

KEYS = [NodeIdentity.ephemeral() for _ in range(5)]
RUN = "run-a"


def signed(
    caller: NodeIdentity,
    server: NodeIdentity,
    step: int,
    *,
    kind: str = "weights",
    run: str = RUN,
    binding: str | None = None,
    at: int | None = None,
) -> Receipt:
    """A receipt both partners signed, as an exchange makes it (each side signs, the other countersigns)."""
    terms = ReceiptTerms(
        run,
        kind,
        caller.peer_id,
        server.peer_id,
        step,
        step,
        1280,
        1280,
        "aa" * 32,
        "bb" * 32,
        binding or f"nonce-{caller.peer_id[-4:]}-{server.peer_id[-4:]}-{kind}-{step}",
        int(time.time()) if at is None else at,
    )
    caller_part = ReceiptDraft.sign(caller, terms, server.public_key.to_bytes(), caller_side=True)
    server_part = ReceiptDraft.sign(server, terms, caller.public_key.to_bytes(), caller_side=False)
    receipt = server_part.countersigned(caller_part.own_signature)
    assert caller_part.countersigned(server_part.own_signature) == receipt  # both sides hold the same receipt
    return receipt


def lines(*receipts: Receipt) -> list[tuple[str, str]]:
    return [(f"test:{i}", r.to_json()) for i, r in enumerate(receipts)]


def test_a_receipt_needs_both_partners_signatures_over_the_same_terms() -> None:
    a, b, c = KEYS[:3]
    receipt = signed(a, b, 3)
    receipt.check()
    assert Receipt.from_json(receipt.to_json()) == receipt
    terms = receipt.terms
    caller_part = ReceiptDraft.sign(a, terms, b.public_key.to_bytes(), caller_side=True)
    # The server signing other terms (another step) is no countersignature of the caller's.
    other = ReceiptDraft.sign(b, dataclasses.replace(terms, server_step=4), a.public_key.to_bytes(), caller_side=False)
    with pytest.raises(ReceiptError) as refused:
        caller_part.countersigned(other.own_signature)
    assert refused.value.reason == "bad_signature"
    # A third key cannot sign in the partner's place: its key is not the named partner's.
    forged = dataclasses.replace(
        receipt,
        server_key=c.public_key.to_bytes().decode(),
        server_signature=c.private_key.sign(terms.message()).decode(),
    )
    with pytest.raises(ReceiptError) as refused:
        forged.check()
    assert refused.value.reason == "wrong_signer"
    # One key cannot be both partners.
    with pytest.raises(ReceiptError) as refused:
        signed(a, a, 1).check()
    assert refused.value.reason == "self_signed"


def test_the_ledger_refuses_forged_altered_replayed_and_other_run_receipts_with_their_reason() -> None:
    a, b, c = KEYS[:3]
    good = [signed(a, b, 1), signed(b, a, 2), signed(a, c, 3)]
    altered = dataclasses.replace(good[0], terms=dataclasses.replace(good[0].terms, caller_step=9, binding="moved"))
    forged = dataclasses.replace(good[2], server_signature=good[2].caller_signature)
    other_run = signed(a, b, 4, run="run-b")
    replayed = signed(b, c, 5, binding=good[1].terms.binding)  # the same call binding, other terms
    future = signed(b, c, 6, at=int(time.time()) + 3600)
    torn = good[0].to_json()[:80]
    ledger = build_ledger([*lines(*good[:2], altered, forged, other_run, replayed, future), ("test:torn", torn)])
    assert ledger.run == RUN and ledger.receipts == 2  # good[2] came only as its forgery
    assert dict(ledger.refused) == {"bad_signature": 2, "other_run": 1, "replayed": 1, "future": 1, "malformed": 1}
    assert {r.reason for r in ledger.refusals} == set(ledger.refused)
    assert ledger.members[a.peer_id].blends == 2 and ledger.members[b.peer_id].blends == 2
    assert c.peer_id not in ledger.members
    # Free keys that learned an honest call's nonce and sign a receipt of their own under it, read first: another
    # caller's call, counted apart, and the honest receipt still counts.
    x, y = KEYS[3:5]
    squatted = build_ledger(lines(signed(x, y, 1, binding=good[0].terms.binding), good[0]))
    assert squatted.refused == {} and squatted.members[a.peer_id].blends == 1
    report = format_ledger(ledger)
    assert "bad_signature 2" in report and "other_run 1" in report


def test_each_partners_copy_counts_once_and_a_member_once_per_step_and_kind() -> None:
    a, b, c = KEYS[:3]
    first = signed(a, b, 7)
    again = signed(a, c, 7)  # a credited a second time at its step 7 (a weights swap): c's credit stands
    meet = signed(a, b, 7, kind="meet")  # a reservation: an exchange, not a blend
    ledger = build_ledger(lines(first, first, again, meet))
    assert ledger.duplicates == 1 and ledger.receipts == 3
    assert ledger.refused == {"counted_twice": 1}
    assert ledger.members[a.peer_id].blends == 1 and ledger.members[a.peer_id].exchanges == {"weights": 1, "meet": 1}
    assert ledger.members[a.peer_id].tokens == 1280  # its claim, once for its one blended step
    assert ledger.members[c.peer_id].blends == 1 and ledger.members[c.peer_id].partners == {a.peer_id}


def test_a_pair_that_only_signs_for_itself_is_a_closed_cluster_apart_from_the_swarm() -> None:
    a, b, c, x, y = KEYS
    swarm = [signed(a, b, 1), signed(b, c, 2), signed(c, a, 3), signed(a, b, 4)]
    sybil = [signed(x, y, step) for step in range(1, 30)]  # many receipts, all signed by the pair alone
    ledger = build_ledger(lines(*swarm, *sybil))
    assert ledger.clusters[0] == sorted([a.peer_id, b.peer_id, c.peer_id])
    assert ledger.clusters[1:] == [sorted([x.peer_id, y.peer_id])]
    assert ledger.members[x.peer_id].partners == {y.peer_id}
    assert "closed cluster" in format_ledger(ledger) and json.loads(json.dumps(ledger.as_dict()))["closed_clusters"]
    # A node's quarantine is shown beside the ledger, never applied to it: the member keeps every blend.
    held = build_ledger(lines(*swarm, *sybil), quarantined={x.peer_id: "norm_bound", "nlgone": "bad_seal"})
    assert held.quarantined == {x.peer_id: "norm_bound"} and held.members[x.peer_id].blends == 29
    report = format_ledger(held)
    assert report.index("quarantined by the node asked") < report.index(x.peer_id) and "norm_bound" in report


def test_the_book_appends_pages_by_offset_and_survives_a_torn_line(tmp_path: Path) -> None:
    a, b = KEYS[:2]
    book = ReceiptBook(tmp_path)
    receipts = [signed(a, b, step) for step in range(5)]
    for receipt in receipts:
        book.add(receipt)
    assert book.count == 5 and book.page(3, 10) == [r.to_json() for r in receipts[3:]] and book.page(5, 10) == []
    with (tmp_path / "receipts.jsonl").open("a") as file:
        file.write(receipts[0].to_json()[:50])  # a crash mid-line
    reopened = ReceiptBook(tmp_path)
    reopened.add(receipts[1])
    assert reopened.count == 7 and reopened.page(6, 1) == [receipts[1].to_json()]
    ledger = build_ledger(read_receipt_files([tmp_path]))
    assert ledger.refused == {"malformed": 1} and ledger.receipts == 5 and ledger.duplicates == 1
