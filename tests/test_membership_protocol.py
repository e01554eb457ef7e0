"""The live membership protocol on an in-process TCPStore: this process is one member, the test plays the others
by writing their records where the protocol reads them (adaptive.runtime.live_protocol names every key)."""

from __future__ import annotations

import datetime
import time

import portpicker
import pytest
import torch.distributed as dist

from adaptive.runtime import admitting, env, membership, reforming
from adaptive.runtime.job import reset_job
from adaptive.runtime.live_protocol import (CURRENT_KEY, HUNG, Generation, GenerationKeys, GenerationState, Member,
                                            beat_key, dead_key)


@pytest.fixture
def store(monkeypatch):
    """A launchers' store on 127.0.0.1 and this process formed alone into generation 1; yields the job's keys."""
    port = portpicker.pick_unused_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=10),
                           wait_for_workers=False)
    monkeypatch.setenv(env.LIVE_STORE_VAR, f"127.0.0.1:{port}")
    monkeypatch.setenv("ADAPTIVE_JOB_ID", "protocol-unit")
    monkeypatch.setenv("ADAPTIVE_LIVE_HANG_TIMEOUT", "1")
    reset_job()
    try:
        first = membership.join(10.0)
        assert first is not None and first.number == 1 and first.members == (membership.membership().me(),)
        yield membership.membership().store
    finally:
        reset_job()
        del server


def _with_others(store, *others: Member) -> Generation:
    """Make this process a member of a running generation 2 with ``others`` after it."""
    generation = Generation(2, (membership.membership().me(),) + others)
    membership.publish(store, generation)
    membership.enter(generation)
    return generation


def test_the_generation_and_its_members_round_trip_through_json():
    generation = Generation(4, (Member(1, 1, 0), Member(7, 2, 1)), joiners=(7,))
    again = Generation.from_json(generation.to_json())
    assert again == generation and again.rank_of(7) == 1 and again.members[1] == Member(7, 2, 1)
    assert again.rank_of(3) is None and GenerationKeys(4).join_waiting(2) == "gen/4/join/2/waiting"


def test_formation_publishes_the_generation_running(store):
    assert store.get(CURRENT_KEY).decode() == "1"
    assert store.get(GenerationKeys(1).state).decode() == GenerationState.RUNNING.value
    assert membership.is_member() and membership.generation_number() == 1


def test_admission_takes_only_joiners_that_still_wait_and_live(store):
    keys = GenerationKeys(1)
    requests = [(101, time.time()), (102, time.time() - 60), (103, time.time())]
    for position, (wid, said) in enumerate(requests, start=1):
        store.add(keys.joins, 1)
        store.set(keys.join_waiting(position), repr(said))
        store.set(keys.join(position), Member(wid, 9, 0).to_json())
    store.set(dead_key(103), "1")  # its launcher reaped it after it asked
    assert admitting.pending_joins() == 3
    me = membership.membership().wid
    following = admitting.close_generation([me], joins=3)
    assert [m.wid for m in following.members] == [me, 101] and following.joiners == (101,)
    assert store.get(keys.state).decode() == GenerationState.CLOSED.value


def test_rank_0_does_not_wait_for_a_joiner_its_launcher_reported_dead(store):
    following = Generation(2, (membership.membership().me(), Member(101, 9, 0)), joiners=(101,))
    store.set(dead_key(101), "1")
    started = time.monotonic()
    assert not admitting.await_arrivals(following, timeout=5.0)
    assert time.monotonic() - started < 1.0
    instead = admitting.abandon_admission(following)
    assert [m.wid for m in instead.members] == [membership.membership().wid] and instead.number == 3
    assert store.get(following.keys.state).decode() == GenerationState.FAILED.value


def test_re_forming_keeps_the_members_that_say_they_live_and_leaves_the_dead(store):
    alive, dead = Member(201, 2, 0), Member(202, 3, 0)
    current = _with_others(store, alive, dead)
    store.set(current.keys.alive(alive.wid), "1")
    store.set(dead_key(dead.wid), "1")
    agreed = reforming.reform_after_loss(timeout=5.0)
    assert agreed is not None and [m.wid for m in agreed.members] == [membership.membership().wid, alive.wid]
    assert agreed.number == 3 and store.get(CURRENT_KEY).decode() == "3"
    assert store.get(current.keys.state).decode() == GenerationState.CLOSED.value


def test_a_member_left_out_of_the_first_proposal_is_taken_for_dead(store):
    other = Member(201, 2, 0)
    current = _with_others(store, other)
    store.set(current.keys.after_loss, Generation(3, (other,)).to_json())  # the other one proposed first
    store.set(current.keys.alive(other.wid), "1")
    assert reforming.reform_after_loss(timeout=5.0) is None
    assert store.get(CURRENT_KEY).decode() == "2"  # this one did not publish the generation it is not in


def test_meeting_finds_a_member_lost_after_the_generation_was_agreed(store):
    other, lost = Member(201, 2, 0), Member(202, 3, 0)
    following = Generation(2, (membership.membership().me(), other, lost))
    store.set(following.keys.here(other.wid), "1")
    store.set(dead_key(lost.wid), "1")
    started = time.monotonic()
    assert reforming.meet(following, timeout=5.0) == [lost.wid]
    assert time.monotonic() - started < 1.0
    store.delete_key(dead_key(lost.wid))
    store.set(following.keys.here(lost.wid), "1")
    assert reforming.meet(following, timeout=5.0) == []


def test_a_launchers_report_of_a_dead_member_ends_the_waits_and_is_said_for_the_others(store):
    other = Member(201, 2, 0)
    current = _with_others(store, other)
    assert not reforming.loss_reported()
    store.set(dead_key(other.wid), "1")
    time.sleep(reforming.HANG_CHECK_INTERVAL)
    assert reforming.loss_reported() and store.check([current.keys.lost])


def test_a_member_whose_sign_of_life_stops_is_taken_out_as_hung(store):
    other = Member(201, 2, 0)
    current = _with_others(store, other)
    store.add(beat_key(other.wid), 1)  # it gave one sign of life, then stopped
    deadline = time.monotonic() + 10
    while not reforming.loss_reported() and time.monotonic() < deadline:
        store.add(beat_key(membership.membership().wid), 0)
        time.sleep(0.1)
    assert store.get(dead_key(other.wid)).decode() == HUNG and store.check([current.keys.lost])
    assert membership.is_dead(other)


def test_this_process_gives_signs_of_life(store):
    key = beat_key(membership.membership().wid)
    first = int(store.add(key, 0))
    time.sleep(1.2)
    assert int(store.add(key, 0)) > first


def test_a_drain_request_waits_until_served_and_names_its_node_once(store, monkeypatch):
    from adaptive.elastic import live
    from adaptive.runtime import draining

    assert draining.pending_drains(store) == 0 and live.drains_seen() == 0
    draining.request_drain(store, 2)
    draining.request_drain(store, 2)  # asked twice: one request
    assert draining.pending_drains(store) == 1 and live.drains_seen() == 1  # rank 0 reads it for the agreement
    assert draining.is_drained(store, 2) and not draining.is_drained(store, 1)
    monkeypatch.setenv(env.LIVE_NODE_VAR, "2")
    live._leave_if_drained(1)
    assert live.leave_requested()  # this member's node was drained: it leaves
    draining.mark_served(store, 1)
    assert draining.pending_drains(store) == 0
    with pytest.raises(ValueError, match="node must be"):
        draining.request_drain(store, 0)
