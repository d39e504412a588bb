"""bench protocol (noloco_bench/swarm_protocol.py): the node's discovery, standing and pairing in emulated time."""

from __future__ import annotations

from dataclasses import replace

from noloco_bench.swarm_protocol import (
    ANSWERING_PEERS,
    ENTRY_BYTES,
    REQUEST_BYTES,
    Clock,
    EmulatedDHT,
    ProtocolSettings,
    _groups,
    run,
)
from noloco_node.discovery.buckets import MAX_BUCKET_ENTRIES, Bucket
from noloco_node.discovery.dht import PeerRecord


def test_the_emulated_dht_bounds_a_key_and_charges_its_readers_per_entry() -> None:
    clock = Clock()
    dht = EmulatedDHT(clock)
    bucket = Bucket(0, 0)
    stored = [dht.store(bucket, PeerRecord(f"p{i}", "11.0.0.1:7000", "fp"), 30.0)[0] for i in range(300)]
    assert stored.count(True) == MAX_BUCKET_ENTRIES  # past the bound a new key is refused, as by every DHT peer
    assert dht.store(bucket, PeerRecord("p3", "11.0.0.1:7000", "fp", outer_step=1), 40.0)[0]  # a refresh is not
    entries, cost = dht.read(bucket)
    assert len(entries) == MAX_BUCKET_ENTRIES
    assert cost == ANSWERING_PEERS * (REQUEST_BYTES + MAX_BUCKET_ENTRIES * ENTRY_BYTES)
    clock.run_until(35.0)
    assert [record.peer_id for record, _ in dht.read(bucket)[0]] == ["p3"]  # the others expired at 30 s


def test_a_swarm_of_honest_members_settles_its_level_and_each_run_of_a_seed_is_the_same() -> None:
    settings = ProtocolSettings(members=100, seconds=150.0, warmup=60.0, hostile_share=0.0, churn_per_hour=0.0)
    first, again = run(settings), run(settings)
    assert {k: v for k, v in first.items() if k != "simulation_cpu_s"} == {
        k: v for k, v in again.items() if k != "simulation_cpu_s"
    }
    # 100 members at 8 records a bucket: level 3 or 4 (hysteresis), every member's estimate near the swarm's size
    assert first["level_median"] in (3, 4) and 70 <= first["estimate_median"] <= 140
    assert first["rounds"] > 100 and first["hostile_share_of_blends"] == 0.0
    # A lookup a second of one bucket of 6-13 records: tens of KB/s per member, not the swarm's size in records
    assert 10_000 < first["discovery_bytes_per_member_s"] < 200_000


def test_draw_then_meet_pairs_a_swarm_whose_phases_run_at_random_offsets_where_calls_to_ready_records_do_not() -> None:
    """Outer steps of 30 s at random offsets, records read seconds late: calls to records flagged ready mostly meet
    rounds that closed meanwhile, while a partner asked during the phase (draw, then meet) is there at the step;
    with every group whose record was seen long enough a partner (``known``), nearly every step blends."""
    settings = ProtocolSettings(members=100, seconds=330.0, warmup=150.0, hostile_share=0.0, churn_per_hour=0.0)
    ready = run(replace(settings, pairing="ready", partners="established"))  # the node's rules before 2026-11-29
    reserve = run(settings)  # the node's: draw, then meet, with partners known by their record's age
    assert ready["blend_rate"] < 0.6, ready
    assert reserve["blend_rate"] >= 0.9 and reserve["members_below_90_percent"] <= 10, reserve
    assert reserve["rounds"] >= 0.9 * ready["rounds"]  # the same swarm: as many outer steps taken


def test_the_late_blends_groups_say_whether_the_swarm_mixes_as_one() -> None:
    members = ["a", "b", "c", "d", "e"]
    assert _groups(members, [("a", "b"), ("b", "c"), ("d", "e"), ("e", "d")]) == [3, 2]  # two separate swarms
    assert _groups(members, [("a", "b"), ("c", "d"), ("b", "c"), ("x", "a")]) == [4, 1]  # a gone member joins none
    assert _groups(members, [("a", "b"), ("b", "c"), ("c", "d"), ("d", "e")]) == [5]


def test_claimed_slots_hold_an_always_ready_group_to_one_honest_partner_an_outer_step() -> None:
    """The "claimed" candidate: a member that reserves another group's member claims that group's outer step in the
    DHT and reads it back; a claim already there is a no. Always-ready hosts then meet one honest member an outer
    step each, where under the node's rule they meet a dozen and take most of a short run's blends."""
    settings = ProtocolSettings(members=60, seconds=240.0, warmup=90.0, hostile_share=0.1, churn_per_hour=0.0)
    node_rule, claimed = run(settings), run(replace(settings, pairing="claimed"))
    assert node_rule["most_blends_of_a_hostile_group_at_one_step"] > 5, node_rule
    assert node_rule["hostile_share_of_blends"] > 0.5, node_rule
    # Why: at a moment fewer honest members are free than there are hostile groups, which always are
    assert node_rule["honest_looking_mean"] < node_rule["hostile_hosts"], node_rule
    assert claimed["most_blends_of_a_hostile_group_at_one_step"] == 1, claimed
    assert claimed["hostile_share_of_blends"] < 0.2, claimed  # hosts: 10.4%
    assert claimed["blend_rate"] >= 0.95 and claimed["members_below_90_percent"] == 0, claimed


def test_a_hostile_host_with_many_keys_stays_at_the_honest_members_outer_step() -> None:
    """A hostile key takes its outer step from the honest records of its view: with 16 keys a host, most of a key's
    view is its fellows', and a step taken from them too fell behind the honest members' reach (--max-staleness),
    so the bench reported 3.5% where the hosts take every blend they can."""
    settings = ProtocolSettings(
        members=60, seconds=240.0, warmup=90.0, hostile_share=0.1, churn_per_hour=0.0, keys_per_hostile=16
    )
    assert run(settings)["hostile_share_of_blends"] > 0.5
