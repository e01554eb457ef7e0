"""The live membership protocol on an in-process TCPStore: this process is one member, the test plays the others
by writing their records where the protocol reads them (adaptive.runtime.live_protocol names every key).

Each case runs twice: without a secret, and with one (``[signed]``: every record is signed and verified, the
records the test writes through the member's own store included, as another member's would be)."""

from __future__ import annotations

import datetime
import threading
import time

import portpicker
import pytest
import torch.distributed as dist

from adaptive.runtime import admitting, env, membership, reforming, signed_records, step_commit
from adaptive.runtime import step as step_records
from adaptive.runtime.job import reset_job
from adaptive.runtime.live_protocol import (CURRENT_KEY, HUNG, Candidate, Generation, GenerationKeys, GenerationState,
                                            Member,
                                            beat_key, dead_key, job_prefix)
from adaptive.runtime.step import StepContext

from protocol_harness import with_others


@pytest.fixture(params=["unsigned", "signed"])
def store(monkeypatch, request):
    """A launchers' store on 127.0.0.1 and this process formed alone into generation 1; yields the job's keys."""
    port = portpicker.pick_unused_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=10),
                           wait_for_workers=False)
    monkeypatch.setenv(env.LIVE_STORE_VAR, f"127.0.0.1:{port}")
    monkeypatch.delenv(env.LIVE_SECRET_FILE_VAR, raising=False)
    if request.param == "signed":
        monkeypatch.setenv(env.LIVE_SECRET_VAR, "protocol-unit-secret-0123456789")
    else:
        monkeypatch.delenv(env.LIVE_SECRET_VAR, raising=False)
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


def test_the_generation_and_its_members_round_trip_through_json():
    generation = Generation(4, (Member(1, 1, 0), Member(7, 2, 1)), joiners=(7,))
    again = Generation.from_json(generation.to_json())
    assert again == generation and again.rank_of(7) == 1 and again.members[1] == Member(7, 2, 1)
    assert again.rank_of(3) is None and GenerationKeys(4).join_waiting(2) == "gen/4/join/2/waiting"


def test_formation_publishes_the_generation_running(store):
    assert store.get(CURRENT_KEY).decode() == "1"
    assert store.get(GenerationKeys(1).state).decode() == GenerationState.RUNNING.value
    assert membership.is_member() and membership.generation_number() == 1


def test_a_worker_started_after_training_finished_forms_a_generation_without_waiting_for_peers(store, monkeypatch):
    """A worker its launcher restarted once the job had ended (say, its process aborted at exit) must not wait for
    the minimum of members, who will never come: once rank 0 said training finished, it forms alone."""
    membership.mark_finished()  # the generation itself may still be marked running (its members are ending)
    monkeypatch.setenv(env.LIVE_MIN_VAR, "3")
    reset_job()
    started = time.monotonic()
    formed = membership.join(10.0)
    assert formed is not None and formed.number == 2 and formed.members == (membership.membership().me(),)
    assert time.monotonic() - started < 5


def test_without_finished_training_a_formation_waits_for_the_minimum_of_members(store, monkeypatch):
    membership.mark_ended()
    monkeypatch.setenv(env.LIVE_MIN_VAR, "3")
    reset_job()
    with pytest.raises(TimeoutError, match="no generation of the live job took worker"):
        membership.join(2.0)


def test_a_worker_started_after_every_member_was_killed_forms_the_next_generation(store):
    """The only member was SIGKILLed (it could not mark its generation failed; its launcher said it died): the
    worker its launcher starts again forms generation 2 from disk instead of asking the dead one to admit it."""
    store.set(dead_key(membership.membership().wid), "1")
    reset_job()
    formed = membership.join(5.0)
    assert formed is not None and formed.number == 2 and formed.members == (membership.membership().me(),)


@pytest.mark.parametrize("other_built", [True, False])
def test_a_formation_never_mixes_workers_that_start_in_it_with_workers_that_built_already(store, monkeypatch,
                                                                                          other_built):
    """A worker that starts builds its model on the generation's group, one that waited for admission built it
    on its own: they would run different collectives.  When both kinds register, the formation takes the
    workers that start (the others ask it to admit them); workers of one kind are all taken."""
    membership.mark_ended()
    monkeypatch.setenv(env.LIVE_MIN_VAR, "2")
    monkeypatch.setenv(env.LIVE_MAX_VAR, "2")
    reset_job()
    other = Candidate(Member(301, 7, 0), built=other_built)

    def register_the_other():
        keys = GenerationKeys(2)
        time.sleep(0.3)
        client = membership.job_store(membership.connect(5.0), env.job_id())
        client.set(keys.candidate(int(client.add(keys.candidates, 1))), other.to_json())

    helper = threading.Thread(target=register_the_other)
    helper.start()
    try:
        formed = membership.join(10.0, admit_now=False)  # a worker starting: it registers first, and closes
    finally:
        helper.join()
    me = membership.membership().me()
    expected = (me,) if other_built else tuple(sorted((me, other.member), key=lambda m: (m.node, m.local, m.wid)))
    assert formed is not None and formed.number == 2 and formed.members == expected


def test_a_candidate_record_says_whether_the_worker_built_already():
    assert Candidate.from_json(Candidate(Member(3, 1, 0), built=True).to_json()) == Candidate(Member(3, 1, 0), True)
    assert Candidate.from_json(Member(3, 1, 0).to_json()) == Candidate(Member(3, 1, 0), False)


def test_admission_takes_only_joiners_that_still_wait_and_live(store):
    keys = GenerationKeys(1)
    requests = [(101, time.time()), (102, time.time() - 60), (103, time.time())]
    for position, (wid, said) in enumerate(requests, start=1):
        store.add(keys.joins, 1)
        store.set(keys.join_waiting(position), repr(said))
        store.set(keys.join(position), Member(wid, 9, 0).to_json())
    store.set(dead_key(103), "1")  # its launcher reaped it after it asked
    # A signed job counts the requests that still wait (its counter is a hint); an unsigned one, the counter.
    assert admitting.pending_joins() == (1 if signed_records.is_signed(store) else 3)
    me = membership.membership().wid
    following = admitting.close_generation([me], joins=3)
    assert [m.wid for m in following.members] == [me, 101] and following.joiners == (101,)
    assert store.get(keys.state).decode() == GenerationState.CLOSED.value


def test_rank_0_does_not_wait_for_a_joiner_its_launcher_reported_dead(store):
    following = Generation(2, (membership.membership().me(), Member(101, 9, 0)), joiners=(101,))
    store.set(dead_key(101), "1")
    started = time.monotonic()
    assert not admitting.await_arrivals(following, timeout=60.0)
    assert time.monotonic() - started < 30.0, "it waited for the timeout, not for the report"
    instead = admitting.abandon_admission(following)
    assert [m.wid for m in instead.members] == [membership.membership().wid] and instead.number == 3
    assert store.get(following.keys.state).decode() == GenerationState.FAILED.value


def test_re_forming_keeps_the_members_that_say_they_live_and_leaves_the_dead(store):
    alive, dead = Member(201, 2, 0), Member(202, 3, 0)
    current = with_others(store, alive, dead)
    store.set(current.keys.alive(alive.wid), "1")
    store.set(dead_key(dead.wid), "1")
    agreed = reforming.reform_after_loss(timeout=5.0)
    assert agreed is not None and [m.wid for m in agreed.members] == [membership.membership().wid, alive.wid]
    assert agreed.number == 3 and store.get(CURRENT_KEY).decode() == "3"
    assert store.get(current.keys.state).decode() == GenerationState.CLOSED.value


def test_a_member_left_out_of_the_first_proposal_is_taken_for_dead(store):
    other = Member(201, 2, 0)
    current = with_others(store, other)
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
    assert reforming.meet(following, timeout=60.0) == [lost.wid]
    assert time.monotonic() - started < 30.0, "it waited for the timeout, not for the report"
    store.delete_key(dead_key(lost.wid))
    store.set(following.keys.here(lost.wid), "1")
    assert reforming.meet(following, timeout=5.0) == []


def test_a_launchers_report_of_a_dead_member_ends_the_waits_and_is_said_for_the_others(store):
    other = Member(201, 2, 0)
    current = with_others(store, other)
    assert not reforming.loss_reported()
    store.set(dead_key(other.wid), "1")
    time.sleep(reforming.HANG_CHECK_INTERVAL)
    assert reforming.loss_reported() and store.check([current.keys.lost])


def test_a_member_whose_sign_of_life_stops_is_taken_out_as_hung(store):
    other = Member(201, 2, 0)
    current = with_others(store, other)
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

    with_others(store, Member(201, 2, 0))  # node 2 has a member (a signed job counts only its members' nodes)
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


# ---------------------------------------------------------------- the step commit (adaptive.runtime.step_commit)
OTHER = Member(99, 2, 0)


def _in_a_step() -> None:
    """Make a loader step current, as the loader publishes it (the vote happens inside loader loops only)."""
    step_records.stream().current = StepContext(
        loader="0", index=0, micro_step=0, num_micro_steps=1, size=8, planned_size=8, init_batch_size=8,
        local_batch_size=4, num_replicas=2, loss_weight=1.0, padding=False, lr_scaling="auto")
    step_records.begin_step()


def _other_votes(store, keys: GenerationKeys, vote: int) -> None:
    """What the other member's step_commit writes when it completed the step (a signed job: its record too)."""
    if signed_records.is_signed(store):
        store.set(keys.commit_vote(vote % 2, OTHER.wid), str(vote))
    store.add(keys.commit_votes, 1)


def test_a_step_commits_when_every_member_completed_it_and_the_slots_alternate(store):
    keys = with_others(store, OTHER).keys
    for vote in (1, 2, 3):
        _in_a_step()
        assert step_commit.is_voting()
        _other_votes(store, keys, vote)
        assert step_commit.agree() is True and step_records.stream().step_committed
        assert signed_records.read(store, keys.commit_decision(vote % 2)) == f"{vote}:commit"
        assert not store.check([keys.commit_decision((vote + 1) % 2)])  # the vote before's decision is gone
    assert step_commit.commits(2) == 3 and not step_records.faulted()


def test_a_member_that_lost_a_peer_aborts_the_step_for_everyone_and_says_so(store):
    keys = with_others(store, OTHER).keys
    _in_a_step()
    step_records.record_fault(RuntimeError("Connection closed by peer"))
    assert step_commit.agree() is False and step_records.stream().step_aborted
    assert signed_records.read(store, keys.commit_decision(1)) == "1:abort"
    assert store.check([keys.lost])  # a member still in a collective of the step gives up on it too
    assert step_commit.commits(2) == 0


def test_a_vote_that_never_comes_from_a_dead_member_aborts_the_step(store, caplog):
    keys = with_others(store, OTHER).keys
    _in_a_step()
    store.set(dead_key(OTHER.wid), "1")  # its launcher reaped it before it voted
    assert step_commit.agree() is False and signed_records.read(store, keys.commit_decision(1)) == "1:abort"
    assert isinstance(step_records.stream().fault, step_commit.StepNotCommitted)
    # Aborted for the reported death, not at the bound on a decision that never comes.
    assert "no decision on step" not in caplog.text and "died (reported by their launcher)" in caplog.text


def test_the_decision_that_stands_is_the_first_one_written(store):
    keys = with_others(store, OTHER).keys
    _in_a_step()
    store.compare_set(keys.commit_decision(1), "", "1:abort")  # the other member saw a fault first
    assert step_commit.agree() is False  # this member completed the step, and still does not apply it


def test_a_forged_increment_of_the_votes_commits_nothing_in_a_signed_job(store):
    if not signed_records.is_signed(store):
        pytest.skip("without a secret the counter is the vote (no one but the job reaches the store)")
    keys = with_others(store, OTHER).keys
    _in_a_step()
    foreign = dist.TCPStore("127.0.0.1", env.live_store()[1], is_master=False, wait_for_workers=False)
    dist.PrefixStore(job_prefix(env.job_id()), foreign).add(keys.commit_votes, 1)  # as if the other had voted
    answer: list[bool] = []
    voter = threading.Thread(target=lambda: answer.append(step_commit.agree()))
    voter.start()
    time.sleep(0.6)
    assert not answer and not store.check([keys.commit_decision(1)]), "a forged count committed the step"
    store.set(dead_key(OTHER.wid), "1")  # the other never votes: it is lost, and the step aborts
    voter.join(10)
    assert answer == [False]


def test_the_peer_failure_hook_is_installed_once_even_when_torch_wraps_it(monkeypatch):
    """``init_process_group`` (every live regroup) wraps the excepthook it finds; installing ours again then
    would chain it to a hook that calls it: a recursion instead of the real error's report."""
    import sys

    from adaptive.runtime import peer_failure

    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, error, trace: seen.append(error))
    monkeypatch.setattr(peer_failure, "_installed", {})
    peer_failure.install()
    ours = sys.excepthook
    monkeypatch.setattr(sys, "excepthook", lambda *args: ours(*args))  # as torch wraps it
    peer_failure.install()
    error = ValueError("the script's own error")
    sys.excepthook(ValueError, error, None)
    assert seen == [error]
