"""Partner choice in an open swarm (pairing/standing.py), the norm bound's allowance for drift, and the fates of
a peer whose payload was refused (set aside for drift, quarantined for what no honest peer sends)."""

from __future__ import annotations

import random
from dataclasses import replace

import grpc
import pytest

from noloco_node.discovery.dht import PeerRecord
from noloco_node.pairing.peer_policy import PeerPolicy
from noloco_node.pairing.standing import SHARE_LEAD, Standing, SwarmStep
from noloco_node.security.payload_guard import CEILING, NormGuard
from noloco_node.wire.frames import PayloadError


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def record(peer_id: str, host: str, port: int, step: int = 0) -> PeerRecord:
    return PeerRecord(peer_id, f"{host}:{port}", "run", outer_step=step, ready=True)


def established_swarm(
    clock: Clock, share: float = 0.1, seed: int = 0, standing_seconds: float = 30
) -> tuple[Standing, list[PeerRecord]]:
    standing = Standing(standing_seconds=standing_seconds, stranger_share=share, clock=clock, rng=random.Random(seed))
    honest = [record(f"honest{i}", f"10.0.0.{i + 1}", 7000) for i in range(3)]
    standing.observe(honest, 0, 2)
    for peer in honest:
        standing.blended(peer.peer_id, 0)
    clock.now = standing_seconds + 1
    return standing, honest


def test_a_peer_earns_standing_by_time_seen_and_a_blend_and_nothing_else() -> None:
    clock = Clock()
    standing = Standing(standing_seconds=30, stranger_share=0.1, clock=clock)
    peer = record("p", "10.0.0.1", 7000)
    standing.observe([peer], 0, 2)
    clock.now = 100.0
    assert not standing.established("p")  # seen long enough, never blended
    standing.blended("p", 3)
    assert standing.established("p")
    fresh = Standing(standing_seconds=30, stranger_share=0.1, clock=clock)
    fresh.observe([peer], 0, 2)
    fresh.blended("p", 0)
    assert not fresh.established("p")  # blended, but seen for 0 s
    clock.now = 130.0
    assert fresh.established("p")


def test_a_fresh_key_flood_takes_at_most_the_stranger_share_of_steps_from_one_or_many_addresses() -> None:
    for hosts in (1, 5):
        clock = Clock()
        standing, honest = established_swarm(clock)
        first_is_stranger = 0
        served_stranger = 0
        for step in range(1, 201):
            # A new key every step, each on one of the attacker's hosts; old keys stay live.
            flood = [record(f"key{step}-{k}", f"192.0.2.{k % hosts + 1}", 9000 + k, step=step) for k in range(20)]
            at_step = [record(p.peer_id, p.address.split(":")[0], 7000, step=step) for p in honest]
            live = [*at_step, *flood]
            standing.observe(live, step, 2)
            order = standing.order(live, {})
            # One stranger at most (the turn's), and every honest group: none took more than its share.
            assert sum(not p.peer_id.startswith("honest") for p in order) <= 1
            assert sum(p.peer_id.startswith("honest") for p in order) == 3, step
            if order and order[0].peer_id.startswith("key"):  # called: the call takes the stranger turn (caller.py)
                first_is_stranger += 1
                standing.spend_stranger_turn(order[0].peer_id)
            # Every step, the flood calls in too (a session served takes the turn: node/served.py); then again.
            for attempt in (f"key{step}-0", f"key{step}-1"):
                if standing.may_serve(attempt):
                    served_stranger += 1
                    standing.spend_stranger_turn(attempt)
            clock.now += 1.0
        # The stranger turns, called and served together: 10% of 200 steps, +1 for the bucket's phase.
        assert first_is_stranger + served_stranger <= 21, (first_is_stranger, served_stranger)
        assert first_is_stranger + served_stranger >= 19  # strangers are not shut out either


def test_a_key_that_only_calls_in_never_earns_standing_however_long_it_blends() -> None:
    """Standing needs the peer's record seen in the DHT for --standing-seconds. A key with no record that wins
    blends by calling in (outsider attack 8) stays a stranger: half a replica's weight, stranger turns only, and
    nothing of it in the checkpoint. Once its record shows up, its time starts then."""
    clock = Clock()
    standing, honest = established_swarm(clock)
    for step in range(1, 6):
        standing.blended("caller", step)
        clock.now += 100.0
    assert not standing.established("caller") and not standing.believable("caller")
    assert "caller" not in {entry["peer_id"] for entry in standing.checkpoint_state()}
    standing.observe([*honest, record("caller", "192.0.2.1", 7000)], 6, 2)
    assert not standing.established("caller")  # seen just now
    clock.now += 31.0
    assert standing.established("caller")


def test_two_members_who_are_strangers_to_each_other_meet_once_both_have_earned_a_stranger_turn() -> None:
    """A joiner and a member restarted on a new key both have standing with the same members, none with each other.
    A stranger turn is kept until a stranger uses it: the two meet as soon as both have earned one (10 steps at a
    share of 10%), and then have standing with each other. Turns that lapsed with their step met only when both
    nodes' random steps coincided (1% of steps)."""
    for seed in range(20):
        clock, other_clock = Clock(), Clock()  # each node's own: each has had standing with the members for 31 s
        joiner, members = established_swarm(clock, seed=seed)
        restarted, _ = established_swarm(other_clock, seed=seed + 100)
        met = None
        for step in range(1, 40):
            a, b = record("joiner", "10.0.1.1", 7000, step), record("restarted", "10.0.2.1", 7000, step)
            joiner.observe([*members, b], step, 2)
            restarted.observe([*members, a], step, 2)
            calls = joiner.order([*members, b], {})
            if calls and calls[0].peer_id == "restarted" and restarted.may_serve("joiner"):
                joiner.spend_stranger_turn("restarted")  # the call (caller.py) ...
                restarted.spend_stranger_turn("joiner")  # ... and the session it opened (node/served.py)
                joiner.blended("restarted", step)
                restarted.blended("joiner", step)
                met = step
                break
            clock.now += 1.0
            other_clock.now += 1.0
        assert met is not None and met <= 11, (seed, met)
        clock.now += 31.0
        other_clock.now += 31.0
        assert joiner.established("restarted") and restarted.established("joiner")


def test_the_stranger_turn_goes_to_a_group_drawn_among_records_in_view_not_to_whoever_calls_in_first() -> None:
    """Keys that call in first at every step (one fresh key per step) took every stranger turn of a member, and an
    honest newcomer none. The turn is for a network group drawn at random among the strangers in view: keys with no
    record in view take none, and keys with records on one group take about that group's share."""
    clock = Clock()
    standing, honest = established_swarm(clock, seed=3)
    served: dict[str, int] = {"newcomer": 0, "no record": 0, "attacker group": 0}
    for step in range(1, 401):
        at_step = [replace(p, outer_step=step) for p in honest]
        # Newcomers (one a step, each a stranger for --standing-seconds) on one group; a fresh key with a record,
        # every step, on another.
        newcomer = record(f"newcomer{step}", "10.0.9.1", 7000, step)
        listed = record(f"listed{step}", "192.0.2.1", 9000, step)
        standing.observe([*at_step, newcomer, listed], step, 2)
        # Every step the attacker's keys call in first (one with no record, then the listed one), then the newcomer.
        for caller, kind in (
            (f"unlisted{step}", "no record"),
            (listed.peer_id, "attacker group"),
            (newcomer.peer_id, "newcomer"),
        ):
            if standing.may_serve(caller):
                served[kind] += 1
                standing.spend_stranger_turn(caller)
        clock.now += 1.0
    assert served["no record"] == 0, served
    turns = served["newcomer"] + served["attacker group"]
    assert 38 <= turns <= 41, served  # 10% of 400 steps: every turn is taken
    assert 12 <= served["newcomer"] <= 28, served  # about half: two stranger groups in view


def test_a_stranger_an_established_peer_names_rides_on_that_peers_share_until_it_has_standing() -> None:
    """A joiner that blended with one of this member's established peers is named in that peer's record: from then
    on it is called and served like an established peer, without a stranger turn, its blends counted against its
    introducer's group with the introducer's own (one group's share: G = 3 here), long after the introducer's record
    has moved on to other partners. Before it was named it had only the stranger share's turns, most of them going
    to the groups free keys fill the view with; a stranger's record (the free keys name each other) introduces
    nobody."""
    clock = Clock()
    standing, honest = established_swarm(clock, seed=5, standing_seconds=1000)  # strangers stay strangers here
    attackers = [record(f"key{g}", f"192.0.{g}.1", 9000) for g in range(8)]  # eight groups of free keys
    partners: dict[str, list[int]] = {}
    for step in range(1, 401):
        named = 200 < step <= 203  # halfway honest0 blends with the joiner, names it, then moves on
        at_step = [
            replace(p, outer_step=step, partners=("joiner",) if named and i == 0 else ()) for i, p in enumerate(honest)
        ]
        flood = [replace(a, outer_step=step, partners=("key0", "key1")) for a in attackers]
        joiner = replace(record("joiner", "10.0.9.1", 7000, step), partners=("key2",))
        live = [*at_step, *flood, joiner]
        standing.observe(live, step, 2)
        # The free keys call in first, then the joiner; with nobody served, this node calls (caller.py).
        served = next((c for c in (*flood, joiner) if standing.may_serve(c.peer_id)), None)
        partner = served or next(iter(standing.order(live, {k: v[-1] for k, v in partners.items()})), None)
        clock.now += 1.0
        if partner is None:  # every group's share is spent: a solo step
            continue
        standing.spend_stranger_turn(partner.peer_id)
        standing.blended(partner.peer_id, step)
        partners.setdefault(partner.peer_id, []).append(step)
    attacker_steps = [s for a in attackers for s in partners.get(a.peer_id, [])]
    joiner_steps = partners.get("joiner", [])
    before = [s for s in joiner_steps if s <= 200]
    assert len(before) <= 6 and len(before) + sum(1 for s in attacker_steps if s <= 200) >= 19, partners
    after = [s for s in joiner_steps if s > 203]
    assert len(after) >= 20, len(after)  # part of its introducer's share (a third of the steps), not turns
    introducers_share = [s for s in (*partners["honest0"], *after) if s > 203]
    assert len(introducers_share) >= 50, len(introducers_share)  # about the share of one group of three
    assert sum(1 for s in attacker_steps if s > 200) <= 21  # the stranger share, all that is left to the free keys
    assert not standing.established("key2")  # named by a stranger's record: never introduced


def _one_partner_per_step(
    standing: Standing, honest: list[PeerRecord], clock: Clock, keys: list[PeerRecord], names: bool
) -> dict[str, list[int]]:
    """200 outer steps of a node with one partner each: ``keys`` call in first, every step (named by honest1's
    record if ``names``, else honest1 itself calls in, every step, before them); with none served, the node calls."""
    partners: dict[str, list[int]] = {}
    for step in range(1, 201):
        at_step = [
            replace(p, outer_step=step, partners=tuple(k.peer_id for k in keys) if names and i == 1 else ())
            for i, p in enumerate(honest)
        ]
        live = [*at_step, *(replace(k, outer_step=step) for k in keys)]
        standing.observe(live, step, 2)
        callers = keys if names else [at_step[1], *keys]
        served = next((c for c in callers if standing.may_serve(c.peer_id)), None)
        partner = served or next(iter(standing.order(live, {k: v[-1] for k, v in partners.items()})), None)
        clock.now += 1.0
        if partner is None:  # every group's share is spent: a solo step
            continue
        standing.spend_stranger_turn(partner.peer_id)
        standing.blended(partner.peer_id, step)
        partners.setdefault(partner.peer_id, []).append(step)
    return partners


def test_a_peer_with_standing_that_names_many_keys_gives_them_its_own_share_never_more() -> None:
    """A member that turned names eight fresh keys on eight groups in its record, and they call in at every step:
    they are served on its share, the member and all it names counted as the one group the member is. They take
    what the member takes calling in at every step itself, and the stranger turns (which any stranger may win),
    never more; and once this node is out of reach of every established peer (it fell behind), nobody rides on a
    share: it catches up."""
    named_keys = [record(f"named{g}", f"192.0.{g}.1", 9000) for g in range(8)]
    taken = {}
    for names in (False, True):
        clock = Clock()
        standing, honest = established_swarm(clock, seed=7, standing_seconds=1000)  # strangers stay strangers
        partners = _one_partner_per_step(standing, honest, clock, named_keys, names)
        taken[names] = sum(len(partners.get(p, [])) for p in ("honest1", *(k.peer_id for k in named_keys)))
        # The others keep what the keys and the stranger turns leave them: two thirds of the steps (honest1's share
        # is one blend in three), a little less.
        assert len(partners.get("honest0", [])) >= 35 and len(partners.get("honest2", [])) >= 35, partners
    assert taken[True] <= taken[False] + 200 / 10 + 3, taken
    # Out of reach of every established peer (they are far ahead): a named key is served on a stranger turn only.
    ahead = [replace(p, outer_step=500, partners=("named0",)) for p in honest]
    served = 0
    for step in range(201, 241):
        live = [*ahead, replace(named_keys[0], outer_step=step)]
        standing.observe(live, step, 2)
        if standing.may_serve("named0"):
            served += 1
            standing.spend_stranger_turn("named0")
        clock.now += 1.0
    assert served <= 5, served


def test_a_record_names_the_established_peers_of_the_latest_blends_latest_first() -> None:
    """Established partners only: a free key that won one stranger turn here is not introduced to the nodes that
    trust this one."""
    clock = Clock()
    standing = Standing(standing_seconds=30, stranger_share=0.1, clock=clock)
    assert standing.recent_partners() == ()
    standing.observe([record(p, f"10.0.0.{i + 1}", 7000) for i, p in enumerate("abc")], 0, 2)
    clock.now = 40.0  # a, b and c seen for 40 s
    for step, peer in enumerate(("a", "b", "c", "b", "fresh")):
        clock.now = 40.0 + step
        standing.blended(peer, step)
    assert standing.recent_partners() == ("b", "c")  # "fresh", the latest, is no one's to introduce
    named = replace(record("x", "10.0.0.1", 7000), partners=("b", "c"))
    read = PeerRecord.from_value("x", named.to_value())
    assert read is not None and read.partners == ("b", "c")  # through the DHT's value and back


def test_without_established_peers_in_view_strangers_are_let_in_at_every_step_but_not_when_they_are_ahead() -> None:
    """Nobody with standing in view (a new swarm, a joiner, a partition): strangers at every step. Established peers
    in view but beyond reach (this node fell behind): the stranger share only, while the node catches up; an
    attacker that keeps it behind (records at its step) buys no more than that."""
    clock = Clock()
    standing = Standing(standing_seconds=30, stranger_share=0.1, clock=clock)
    strangers = [record(f"s{i}", "10.0.0.9", 7000 + i) for i in range(3)]
    for step in range(10):
        standing.observe(strangers, step, 2)
        assert standing.may_serve("s0")
        assert len(standing.order(strangers, {})) == 3  # nobody better: every candidate, one host at a time
    established, honest = established_swarm(clock, share=0.0)
    far = [record(p.peer_id, p.address.split(":")[0], 7000, step=50) for p in honest]  # all beyond max_staleness
    near = [record(f"s{i}", "10.0.0.9", 7000 + i, step=10) for i in range(3)]
    for step in range(10, 20):
        established.observe([*far, *near], step, 2)
        assert not established.may_serve("s0")
        assert established.order(near, {}) == []  # whom to call: nobody within reach has standing
    established.observe(near, 20, 2)  # the established peers gone from view (a partition): strangers again
    assert established.may_serve("s0")


def test_a_thousand_keys_on_one_host_weigh_as_one_host() -> None:
    clock = Clock()
    standing = Standing(standing_seconds=0, stranger_share=1.0, clock=clock, rng=random.Random(1))
    sybils = [record(f"sybil{i}", "192.0.2.1", 9000 + i) for i in range(1000)]
    loner = record("loner", "198.51.100.7", 7000)
    picks = 0
    for step in range(400):
        standing.observe([*sybils, loner], step, 2)
        picks += standing.order([*sybils, loner], {})[0].peer_id == "loner"
    assert 140 <= picks <= 260  # one host of two: about half, not 1/1001


def test_established_peers_come_host_by_host_least_recently_paired_first() -> None:
    clock = Clock()
    standing = Standing(standing_seconds=0, stranger_share=0.0, clock=clock)
    peers = [record("a1", "10.0.0.1", 1), record("a2", "10.0.0.1", 2), record("b", "10.0.0.2", 1)]
    standing.observe(peers, 0, 2)
    for peer in peers:
        standing.blended(peer.peer_id, 0)
    standing.observe(peers, 2, 2)  # past the window of step 0's blends (G = 2 hosts: 2 outer steps)
    order = [p.peer_id for p in standing.order(peers, {"a1": 5, "a2": 1, "b": 3})]
    # Host 10.0.0.1 was paired at step 5 (a1): b (3) comes first, then that host's least recently paired key, a2. A
    # host with a key it has not used yet does not come first again for it.
    assert order == ["b", "a2", "a1"]


def test_standing_survives_a_partition_and_steps_apart_count_this_nodes_own_steps() -> None:
    clock = Clock()
    standing, honest = established_swarm(clock)
    standing.observe(honest, 4, 2)
    standing.blended("honest0", 4)
    for step in range(5, 40):  # honest0 gone from the DHT view (a partition) for 35 steps
        standing.observe(honest[1:], step, 2)
    assert standing.established("honest0") and standing.steps_apart("honest0") == 35
    assert standing.steps_apart("never-seen") is None


def test_a_key_that_won_one_stranger_step_buys_no_looser_bound_and_a_flood_evicts_no_standing() -> None:
    from noloco_node.pairing import standing as module

    clock = Clock()
    standing, honest = established_swarm(clock)
    standing.observe([*honest, record("stranger", "192.0.2.9", 1)], 1, 2)
    standing.blended("stranger", 1)  # in a stranger step
    for step in range(2, 20):
        standing.observe(honest, step, 2)
    assert standing.steps_apart("stranger") is None  # no standing: the bound of one phase, however long away
    assert standing.steps_apart("honest0") == 19
    # honest0 leaves the DHT (a partition) while more fresh keys than the table holds pass through.
    for batch in range(module.MAX_REMEMBERED // 500 + 2):
        clock.now += 1.0
        keys = [record(f"k{batch}-{i}", "192.0.2.1", 9000 + i, step=20) for i in range(500)]
        standing.observe([*honest[1:], *keys], 20, 2)
    assert standing.established("honest0")


def test_the_norm_bound_allows_for_drift_since_the_last_blend_up_to_a_limit() -> None:
    guard = NormGuard(fixed=0.1)
    guard.admit(0.099, "p")
    with pytest.raises(PayloadError) as refused:
        guard.admit(0.15, "p")
    assert refused.value.reason == "norm_bound" and refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    guard.admit(0.15, "p", steps_apart=3)  # bound 0.1 * sqrt(4) = 0.2
    with pytest.raises(PayloadError):
        guard.admit(0.5, "p", steps_apart=1000)  # at most sqrt(16) = 4x
    with pytest.raises(PayloadError):
        NormGuard(fixed=0.5).admit(CEILING + 0.01, "p", steps_apart=15)  # never beyond the ceiling


def test_drift_sets_a_peer_aside_for_now_while_a_bad_payload_quarantines_it(tmp_path) -> None:
    from noloco_node.config.node_config import SecurityConfig
    from noloco_node.node.security import NodeSecurity

    security = NodeSecurity(SecurityConfig(), tmp_path)
    policy = PeerPolicy(exchange_timeout=10, min_deadline=1, avoid_seconds=30)
    too_far = PayloadError(grpc.StatusCode.INVALID_ARGUMENT, "norm_bound", "too far")
    security.bad_payload("drifted", too_far, policy)
    assert policy.avoided("drifted") and not policy.quarantined("drifted")
    security.bad_payload("liar", PayloadError(grpc.StatusCode.INVALID_ARGUMENT, "checksum", "bad"), policy)
    assert policy.quarantined("liar")
    assert policy.lift("norm_bound") == ["drifted"]  # caught up: its distance was from weights no longer held
    assert not policy.avoided("drifted") and policy.quarantined("liar")


def test_the_swarms_front_is_corroborated_by_hosts_not_keys() -> None:
    from noloco_node.node.catch_up import credible_front

    honest = [record("a", "10.0.0.1", 1, step=40), record("b", "10.0.0.2", 1, step=41)]
    liars = [record(f"liar{i}", "192.0.2.9", 9000 + i, step=1_000_000) for i in range(2)]
    assert credible_front([*honest, *liars]) == 41  # two keys on one address are one claim
    assert credible_front(liars) == 1_000_000  # one host in sight: two of its peers (nothing better to go on)
    assert credible_front([honest[0], *liars]) == 40  # two hosts: the furthest both claim
    assert credible_front([record("one", "10.0.0.1", 1, step=7)]) == 7
    assert credible_front([]) is None
    # Five hosts, two of them the outsider's: the third-furthest host claim, the furthest honest one.
    many = [record(f"h{i}", f"10.0.0.{i}", 1, step=50 + i) for i in range(3)]
    assert credible_front([*many, *(record(f"x{i}", f"192.0.2.{i}", 1, step=1_000_000) for i in range(2))]) == 52
    same_host = [record(f"n{i}", "127.0.0.1", 7000 + i, step=s) for i, s in enumerate((5, 6, 1_000_000))]
    assert credible_front(same_host) == 6  # a loopback swarm: two claims as before
    # A liar key beside two honest nodes on their address, and two more liar keys on an address of their own: the
    # shared address claims what most of its peers claim (bench outsider once lured a restarting node this way).
    liar_beside = record("liar-beside", "127.0.0.1", 9999, step=1_000_000)
    assert credible_front([*same_host[:2], liar_beside, *liars]) == 6


def test_a_donors_counters_must_be_the_step_its_record_claims_and_short_of_this_runs_end() -> None:
    from noloco_node.node.catch_up import implausible_counters

    donor = record("d", "10.0.0.1", 1, step=12)
    total = 10_000
    assert implausible_counters({"outer_step": 12, "inner_step": 12 * 20 + 7}, donor, 20, total) is None
    assert implausible_counters({"outer_step": 13, "inner_step": 13 * 20}, donor, 20, total) is None  # stepped
    claims = implausible_counters({"outer_step": 1_000_000, "inner_step": 0}, donor, 20, total) or ""
    assert "record says 12" in claims
    assert "inner step" in (implausible_counters({"outer_step": 12, "inner_step": 50_000_000}, donor, 20, total) or "")
    assert "inner step" in (implausible_counters({"outer_step": 12, "inner_step": 3}, donor, 20, total) or "")
    # Consistent with a claim near this run's end, or past it: adopting them would end the node.
    ahead = record("ahead", "10.0.0.2", 1, step=500)
    assert "--steps" in (implausible_counters({"outer_step": 500, "inner_step": 500 * 20}, ahead, 20, total) or "")
    assert implausible_counters({"outer_step": 499, "inner_step": 499 * 20 + 19}, ahead, 20, total) is None
    # A download that outlasted the donor's phases: its record moved from 9 to 12 while it served step 9's state.
    moved_on, when_asked = record("d", "10.0.0.1", 1, step=12), record("d", "10.0.0.1", 1, step=9)
    served = {"outer_step": 9, "inner_step": 9 * 20}
    assert "record says 12" in (implausible_counters(served, moved_on, 20, total) or "")  # the record after alone
    assert implausible_counters(served, moved_on, 20, total, before=when_asked) is None
    older = {"outer_step": 7, "inner_step": 7 * 20}  # older than the record said when the download began
    assert "record says 9 to 12" in (implausible_counters(older, moved_on, 20, total, before=when_asked) or "")


def test_a_restarting_member_takes_no_front_beyond_its_own_pace() -> None:
    from noloco_node.node.catch_up import plausible_reach

    # Outer steps 10-20 took 100 s (10 s each); the checkpoint's last step was 60 s ago.
    history = [{"outer_step": step, "time": 1000.0 + 10 * (step - 10)} for step in range(10, 21)]
    assert plausible_reach(history, 4, now=1100.0 + 60) == 20 + 4 + 12  # twice its pace for 60 s
    assert plausible_reach(history[:1], 4, now=2000.0) is None  # no pace to measure
    assert plausible_reach([], 4, now=2000.0) is None


def test_standing_outlives_a_restart_through_the_checkpoint() -> None:
    clock = Clock()
    standing, honest = established_swarm(clock)
    stranger = record("stranger", "10.9.0.1", 7000)
    standing.observe([*honest, stranger], 0, 2)
    saved = standing.checkpoint_state()
    assert sorted(e["peer_id"] for e in saved) == sorted(p.peer_id for p in honest)  # strangers earned nothing
    restarted = Standing(standing_seconds=30, stranger_share=0.1, clock=Clock())
    restarted.restore([*saved, {"peer_id": "garbled"}])
    assert all(restarted.established(p.peer_id) for p in honest)
    assert not restarted.believable("stranger")  # only the peers it had standing with are believed
    assert restarted.believable(honest[0].peer_id)


def test_once_a_node_has_peers_with_standing_only_their_claims_count() -> None:
    clock = Clock()
    standing = Standing(standing_seconds=30, stranger_share=0.1, clock=clock)
    standing.observe([record("liar", "192.0.2.9", 1)], 0, 2)
    assert standing.believable("liar")  # nobody has standing yet: a joiner believes whom it sees
    standing, _ = established_swarm(clock)
    assert standing.believable("honest0") and not standing.believable("liar")


def test_the_clock_moves_when_half_the_known_hosts_are_ahead_one_with_standing_and_no_further_than_plausible() -> None:
    """After a split heals, the half that is behind moves its clock to the other half's (pairing/standing.py):
    only when at least half of the hosts it knows, itself counted, are beyond reach ahead and one of them has
    standing; each host counts once, whatever its keys; strangers alone move nothing; and never further than twice
    this node's own pace since it last blended with a peer with standing there."""
    clock = Clock()
    standing, honest = established_swarm(clock)  # three established hosts, blended at step 0, time 0; now 31 s
    own = 10
    steps = {p.peer_id: own for p in honest}
    assert standing.swarm_step(own, steps, 2, 1.0) is None  # everyone within reach
    steps[honest[0].peer_id] = 40
    assert standing.swarm_step(own, steps, 2, 1.0) is None  # one of four hosts ahead: it is the one to wait
    steps[honest[1].peer_id] = 30
    assert standing.swarm_step(own, steps, 2, 1.0) == SwarmStep(30, 10)  # two of four: the lower median; 10 steps apart
    # At 4 s a step, 31 s since the last blend allow 2 * 31 / 4 = 15.5 steps, plus the staleness bound of 2.
    assert standing.swarm_step(own, steps, 2, 4.0) == SwarmStep(17, 10)
    assert standing.swarm_step(own, steps, 2, 20.0) is None  # no further than 5: within reach already

    # A host seen long enough counts as known: a node that blended with only one node of the far half still moves.
    partial = Standing(standing_seconds=30, stranger_share=0.1, clock=clock)
    partial.observe(honest, own, 2)
    for peer in (honest[0], honest[2]):
        partial.blended(peer.peer_id, own)
    clock.now += 31
    far_half = {honest[0].peer_id: 40, honest[1].peer_id: 40, honest[2].peer_id: own}
    assert partial.swarm_step(own, far_half, 2, 1.0) == SwarmStep(40, 0)
    assert partial.swarm_step(own, {**far_half, honest[1].peer_id: own}, 2, 1.0) is None  # 1 of 4 ahead
    # Strangers alone move nothing, however many keys and addresses claim to be far ahead.
    strangers = [record(f"s{i}", f"10.9.9.{i}", 7000) for i in range(50)]
    partial.observe(strangers, own, 2)
    clock.now += 31
    claims = {**{p.peer_id: 10**6 for p in strangers}, honest[0].peer_id: own, honest[2].peer_id: own}
    assert partial.swarm_step(own, claims, 2, 1.0) is None
    # Several keys on one host count as one host, at the lower median of their steps.
    keys = [record(f"k{i}", "10.0.0.9", 7000 + i) for i in range(3)]
    multi = Standing(standing_seconds=30, stranger_share=0.1, clock=clock)
    multi.observe([*keys, honest[0]], own, 2)
    for peer in [*keys, honest[0]]:
        multi.blended(peer.peer_id, own)
    clock.now += 31
    claims = {"k0": 40, "k1": 40, "k2": 40, honest[0].peer_id: own}
    # Counted per key, three of five would be ahead; per host it is one of three (this node counted): no move.
    assert multi.swarm_step(own, claims, 2, 1.0) is None
    claims[honest[0].peer_id] = 50
    assert multi.swarm_step(own, claims, 2, 1.0) == SwarmStep(40, 0)  # both hosts ahead: the lower median of theirs


def test_established_keys_of_one_group_calling_in_first_every_step_get_the_share_of_one_group() -> None:
    """An attacker that earned standing for 20 keys on one /24 calls in before anyone else at every step: it is
    served one blend in G outer steps (G = 4 groups: its own and three honest), its share of the groups, and at
    most SHARE_LEAD blends ahead of it, not every step."""
    clock = Clock()
    standing, honest = established_swarm(clock)
    sybils = [record(f"sybil{i}", f"8.8.8.{i + 1}", 7000) for i in range(20)]
    standing.observe(honest + sybils, 0, 2)
    clock.now = 62.0
    for peer in sybils:
        standing.heard_from(peer.peer_id)
    rng = random.Random(3)
    served = 0
    steps = range(1, 401)
    for step in steps:
        standing.observe([replace(p, outer_step=step) for p in honest + sybils], step, 2)
        caller = rng.choice(sybils)
        if standing.may_serve(caller.peer_id):
            served += 1
            standing.blended(caller.peer_id, step)
        else:  # the node pairs with an honest peer (its own call, or theirs)
            standing.blended(rng.choice(honest).peer_id, step)
    assert len(steps) / 4 - 1 <= served <= len(steps) / 4 + SHARE_LEAD, served
    # And alone, one group is all there is: served every step.
    alone = Standing(standing_seconds=0, stranger_share=0.1, clock=clock)
    alone.observe([sybils[0]], 0, 2)
    alone.blended(sybils[0].peer_id, 0)
    for step in range(1, 5):
        alone.observe([replace(sybils[0], outer_step=step)], step, 2)
        assert alone.may_serve(sybils[0].peer_id)
        alone.blended(sybils[0].peer_id, step)


def test_a_group_takes_one_blend_in_g_outer_steps_calling_or_called_and_is_neither_served_nor_called_past_it() -> None:
    """G = 3 honest groups. A group that would blend whenever it may (always ready, calling in first) gets one blend
    in three outer steps, after at most SHARE_LEAD at once; while its share is spent it is neither served nor
    called (an always-ready group must not take by being called what it cannot take by calling in). A group that
    blended less than its share banks nothing: a peer away for a while does not come back to a run of blends."""
    clock = Clock()
    standing, honest = established_swarm(clock)
    eager, others = honest[0].peer_id, [p.peer_id for p in honest[1:]]
    eager_blends, run = 0, 0
    for step in range(10, 70):
        standing.observe([replace(p, outer_step=step) for p in honest], step, 2)
        served = standing.may_serve(eager)
        assert (eager in [p.peer_id for p in standing.order(honest, {})]) is served, step
        if served:
            eager_blends += 1
            run += 1
            assert run <= SHARE_LEAD, step
        else:
            run = 0
        standing.blended(eager if served else others[step % 2], step)
    assert 60 / 3 <= eager_blends <= 60 / 3 + SHARE_LEAD, eager_blends
    # others[0] blended at every other step (its share or more): away for 30 outer steps, it comes back to
    # SHARE_LEAD blends at once, not to the ten it missed.
    for step in range(70, 100):
        standing.observe([replace(p, outer_step=step) for p in honest], step, 2)
        standing.blended(others[1] if step % 2 else eager, step)
    back = 0
    while standing.may_serve(others[0]):
        back += 1
        standing.blended(others[0], 100)
    assert back == SHARE_LEAD, back


def test_a_partner_an_established_peer_names_is_charged_to_its_own_group_in_view_or_not() -> None:
    """A partner of this node that an established peer names in its record (an honest peer names its latest
    partners) counts against its own group's share, whether its record is in this node's view or not. Charged to the
    naming peer's group while out of view, its group's other keys blended again a few steps after it, where the
    group's share was one blend in G outer steps: 100 honest members with 10% always-ready hosts of 4 keys, the hosts
    took 23% of the blends over 3 hours (bench protocol)."""
    clock = Clock()
    standing, honest = established_swarm(clock)  # three honest groups, established at step 0
    hostile = [record("h0", "192.0.2.1", 9000), record("h1", "192.0.2.1", 9001)]  # one host, two keys
    standing.observe([*honest, *hostile], 0, 2)
    clock.now += 31.0  # both keys are partners now
    step = 1
    standing.observe([*honest, *hostile], step, 2)
    while standing.may_serve("h1"):  # h1 takes its group's share: SHARE_LEAD blends at once
        standing.blended("h1", step)
    for step in range(2, 4):  # G = 4 groups: the host's share is spent for a few outer steps
        # honest0 names h1, whose record is out of view; h0 calls in
        live = [
            replace(honest[0], outer_step=step, partners=("h1",)),
            *(replace(p, outer_step=step) for p in honest[1:]),
        ]
        standing.observe([*live, replace(hostile[0], outer_step=step)], step, 2)
        assert not standing.may_serve("h0"), step
        assert "h0" not in [p.peer_id for p in standing.order([*live, hostile[0]], {})], step
    standing.observe([*(replace(p, outer_step=8) for p in honest), *hostile], 8, 2)
    assert standing.may_serve("h0")


def test_records_of_keys_that_never_answer_neither_thin_the_groups_shares_nor_are_called_first() -> None:
    """Fifty records of free keys on groups of their own, seen long enough to be partners, whose addresses never
    answer: G counts the three honest groups that answer, so an honest group still takes one blend in three outer
    steps (not one in 53), and the honest partners are called before the silent ones (a partner never paired would
    otherwise come first: each call to a silent address takes a call's time from the phase). A key that answers once
    is ordered with the others that did."""
    clock = Clock()
    standing, honest = established_swarm(clock)
    silent = [record(f"silent{i}", f"10.1.{i}.1", 7000) for i in range(50)]
    standing.observe([*honest, *silent], 0, 2)
    clock.now += 31.0  # the silent keys are partners too now
    eager = honest[0].peer_id
    eager_blends = 0
    for step in range(1, 61):
        live = [replace(p, outer_step=step) for p in [*honest, *silent]]
        standing.observe(live, step, 2)
        order = [p.peer_id for p in standing.order(live, {})]
        called_honest = [i for i, peer_id in enumerate(order) if peer_id.startswith("honest")]
        assert called_honest and called_honest == list(range(len(called_honest))), (step, order[:4])
        assert len(order) >= 50  # the silent keys are still called, after
        if standing.may_serve(eager):
            eager_blends += 1
            standing.blended(eager, step)
        else:
            standing.blended(honest[1 + step % 2].peer_id, step)
    assert 60 / 3 <= eager_blends <= 60 / 3 + SHARE_LEAD, eager_blends
    standing.heard_from("silent7")
    live = [replace(p, outer_step=61) for p in [*honest, *silent]]
    standing.observe(live, 61, 2)
    assert "silent7" in [p.peer_id for p in standing.order(live, {})][:4]


def test_a_peer_counts_as_heard_from_when_established_peers_of_two_groups_name_it_not_one() -> None:
    """One established peer can name any keys in its record: those neither count in G nor come first. A key the
    records of established peers of two groups name has blended with both: it counts, and comes before the silent."""
    clock = Clock()
    standing, honest = established_swarm(clock)
    named = [record(f"named{i}", f"10.2.{i}.1", 7000) for i in range(20)]
    standing.observe([*honest, *named], 0, 2)
    clock.now += 31.0  # partners by their record's age
    one_namer = [replace(honest[0], partners=(k.peer_id,)) for k in named]
    for step, namer in enumerate(one_namer, start=1):
        standing.observe([namer, *honest[1:], *named], step, 2)
    assert standing._share_groups == 3  # the three honest groups only
    order = [p.peer_id for p in standing.order([*honest, *named], {})]
    assert all(peer_id.startswith("honest") for peer_id in order[:3]), order[:4]
    standing.observe([honest[0], replace(honest[1], partners=("named5",)), honest[2], *named], 30, 2)
    assert standing._share_groups == 4
    assert "named5" in [p.peer_id for p in standing.order([*honest, *named], {})][:4]
