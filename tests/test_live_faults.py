"""Live membership (``adaptive-run --live``) when a fault or a second change lands in the middle of a change.

Real launchers, workers and signals on 127.0.0.1, as in ``test_live.py``:
a worker is SIGKILLed while rank 0 hands the training state to a joiner,
or while a join is being agreed; a join and a leave, or a join and a kill,
land at one boundary.  The moments are found from what the workers log
(``transfer.jsonl``: the hand-over) and from the keys the membership writes
on the launchers' store (a join request: ``gen/<n>/join/<i>``), read here
with a TCPStore client; rank 0 is held with SIGSTOP while the two events
are set up, so that both reach it at the same agreement.  Each case
checks the PIDs (the killed one is gone, the members that live keep theirs),
that every launcher ends as it should, that every step was trained by all
its members from one state and every sample once per epoch.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import time
from pathlib import Path

import portpicker
import psutil
import pytest

from elastic_harness import live_pids, wait_exit, wait_for
from live_harness import check_after_rollbacks, check_steps, exits, launch, logs, steps, wait_steps, worker_pids
from live_harness import jobs  # noqa: F401  (the fixture)

#: The job's name: its keys on the launchers' store are under it.
JOB = "live-faults"
#: What every case's workers do: enough epochs for the changes and the restarts to happen while they train.
SETTINGS = {"WORKER_EPOCHS": "8", "WORKER_STEP_SLEEP": "0.08",
            "ADAPTIVE_CHECKPOINT_INTERVAL": "0", "ADAPTIVE_JOB_ID": JOB}
EPOCHS = int(SETTINGS["WORKER_EPOCHS"])


def _job_store(port: int):
    """The job's keys on the launchers' store (a client of the store the first launcher hosts)."""
    import torch.distributed as dist

    from adaptive.runtime import membership

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30),
                          wait_for_workers=False)
    return membership.job_store(store, JOB)


def _two_members(jobs, out: Path, port: int, **extra: str):
    """Two launchers ("first" hosts the store, "second") of one worker each, training together.

    Returns ``{name: launcher}``, the generation, rank 0's PID and rank 1's.
    """
    launchers = {name: launch(jobs, out, port, name, restarts=2, **SETTINGS, **extra) for name in ("first", "second")}
    records = wait_steps(out, lambda rs: sum(r["world"] == 2 for r in rs) >= 8, "both nodes to train")
    both = [r for r in records if r["world"] == 2]
    rank0, rank1 = (next(r["pid"] for r in reversed(both) if r["rank"] == rank) for rank in (0, 1))
    return launchers, both[-1]["generation"], rank0, rank1


def _wait_launchers(out: Path, launchers: dict, codes: dict[str, int] | None = None) -> None:
    """Every launcher exits with its expected status (``codes``, default 0)."""
    for name, launcher in launchers.items():
        assert wait_exit(launcher, 120, out / f"{name}.log") == (codes or {}).get(name, 0), logs(out)


def _worker_of(launcher) -> int:
    """The PID of a launcher's (only) worker."""
    (pid,) = worker_pids(launcher.pid)
    return pid


def _join_request(store, generation: int) -> dict | None:
    """The first join request posted to running generation ``generation`` (its worker id, node, local rank)."""
    key = f"gen/{generation}/join/1"
    return json.loads(store.get(key)) if store.check([key]) else None


def _signal_pending(pid: int, signum: int) -> bool:
    """Whether ``signum`` waits to be delivered to (stopped) process ``pid``."""
    with open(f"/proc/{pid}/status") as status:
        masks = [line.split()[1] for line in status if line.startswith(("SigPnd:", "ShdPnd:"))]
    return any(int(mask, 16) >> (signum - 1) & 1 for mask in masks)


def _transfers(out: Path) -> list[dict]:
    path = out / "transfer.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _check_survivors(out: Path, survivors: set[int], killed: int, since: float) -> list[dict]:
    """The killed worker is gone and trained nothing after ``since``; each survivor trained again soon after
    (no one waited for a timeout) and finished with 0 in the same process; a worker started after ``since``
    (the killed one's replacement, or a joiner) trained with them.  Returns the steps after ``since``."""
    assert live_pids([killed]) == []
    after = [r for r in steps(out) if r["time"] > since]
    assert killed not in {r["pid"] for r in after}
    before = {r["pid"] for r in steps(out) if r["time"] <= since}
    for pid in survivors:
        assert exits(out).get(pid) == 0, f"survivor {pid} did not finish in its process: {exits(out)}\n{logs(out)}"
        back = min(r["time"] for r in after if r["pid"] == pid)
        assert back - since < 15, f"survivor {pid} trained again only {back - since:.1f} s after the kill"
    assert any(r["pid"] not in before and r["world"] > 1 for r in after), \
        f"no worker joined the survivors: {sorted({(r['pid'], r['world']) for r in after})}"
    return after


@pytest.mark.parametrize("victim", [pytest.param("donor", marks=[pytest.mark.slow, pytest.mark.ci_sample]),
                                    pytest.param("member", marks=[pytest.mark.slow, pytest.mark.ci_sample]),
                                    pytest.param("joiner", marks=[pytest.mark.slow, pytest.mark.ci_sample])])
def test_a_kill_during_the_state_transfer_to_a_joiner(jobs, tmp_path, victim):
    """Two members train; a third node joins, and while rank 0 (the donor) hands it the state (the joiner
    takes 3 s to start receiving, so the donor is inside the hand-over meanwhile) the donor, the other
    member or the joiner is SIGKILLed.  The members that live keep their PIDs and train again within
    seconds: none is left waiting in the hand-over for a peer that gave it up, none is taken for dead.
    A joiner that lost a peer before it trained is started again by its agent, as is the killed worker,
    and they join the survivors."""
    out, port = tmp_path / "job", portpicker.pick_unused_port()
    launchers, generation, donor, member = _two_members(jobs, out, port, WORKER_TRANSFER_LOG="1")
    launchers["third"] = launch(jobs, out, port, "third", restarts=2, WORKER_SLOW_JOIN="3", WORKER_TRANSFER_LOG="1",
                                **SETTINGS)

    def hand_over():
        started = {r["role"]: r for r in _transfers(out) if r["generation"] > generation}
        return started if len(started) == 2 else None

    started = wait_for(hand_over, 60, "the state to be handed to the joiner", interval=0.01)
    transfers = [r for r in _transfers(out) if r["generation"] > generation]
    killed = {"donor": donor, "member": member, "joiner": started["receive"]["pid"]}[victim]
    os.kill(killed, signal.SIGKILL)
    kill_time = time.time()
    assert started["send"]["pid"] == donor, started
    assert all(r["phase"] == "start" for r in transfers), f"the kill came after the hand-over: {transfers}"
    _wait_launchers(out, launchers)

    check_after_rollbacks(out, epochs=EPOCHS)
    _check_survivors(out, {donor, member} - {killed}, killed, kill_time)


@pytest.mark.slow
@pytest.mark.ci_sample
def test_a_kill_while_a_join_is_being_agreed(jobs, tmp_path):
    """Rank 0 is SIGKILLed as soon as a joiner's request is on the store, before any generation admitting
    it was published.  The other member re-forms alone (same PID), the joiner's request to the broken
    generation is answered without it, and the joiner (the same process: it asks the re-formed generation)
    is admitted by the survivor, now rank 0 (at the re-formed generation's first boundary when the request is
    there by then); the killed worker's agent starts it again and it joins too."""
    out, port = tmp_path / "job", portpicker.pick_unused_port()
    launchers, generation, rank0, rank1 = _two_members(jobs, out, port)
    store = _job_store(port)
    launchers["third"] = launch(jobs, out, port, "third", restarts=2, **SETTINGS)
    request = wait_for(lambda: _join_request(store, generation), 60, "the joiner's request", interval=0.005)
    published = store.check([f"gen/{generation}/next"])
    os.kill(rank0, signal.SIGKILL)
    kill_time = time.time()
    joiner = _worker_of(launchers["third"])
    assert not published, "the join was agreed before the kill"
    following = wait_for(lambda: store.check([f"gen/{generation}/next"]) and json.loads(
        store.get(f"gen/{generation}/next")), 60, "the members to re-form")
    assert len(following["members"]) == 1 and request["wid"] not in [m["wid"] for m in following["members"]], \
        f"the members did not re-form without the killed one and the joiner: {following}"
    _wait_launchers(out, launchers)

    check_after_rollbacks(out, epochs=EPOCHS)
    after = _check_survivors(out, {rank1}, rank0, kill_time)
    assert exits(out).get(joiner) == 0 and any(r["pid"] == joiner and r["world"] > 1 for r in after), \
        f"the joiner {joiner} was not admitted in its own process: {exits(out)}\n{logs(out)}"
    # The survivor re-formed alone (the generation after the broken one has it only); it may admit the joiner at
    # the re-formed generation's first boundary, before training a step alone.
    assert any(r["pid"] == rank1 and r["generation"] >= following["number"] for r in after), \
        "the survivor did not train on in the re-formed job"


def _hold_rank0_until(jobs, out: Path, port: int, launchers: dict, rank0: int, generation: int, event) -> int:
    """SIGSTOP rank 0, start a joiner ("third"), wait for its request on the store, then ``event()`` (a
    signal sent while rank 0 cannot act on anything) and SIGCONT: rank 0 sees the join and the event at
    one agreement.  Returns the joiner's PID."""
    store = _job_store(port)
    os.kill(rank0, signal.SIGSTOP)
    try:
        launchers["third"] = launch(jobs, out, port, "third", restarts=2, **SETTINGS)
        wait_for(lambda: _join_request(store, generation), 60, "the joiner's request")
        event()
    finally:
        os.kill(rank0, signal.SIGCONT)
    return _worker_of(launchers["third"])


@pytest.mark.slow
@pytest.mark.ci_sample
def test_a_join_and_a_leave_at_one_boundary(jobs, tmp_path):
    """A node joins while rank 0's node is told to leave (SIGTERM to its launcher), both known to rank 0 at
    one agreement: one change, 2 -> 2 replicas, takes the leaver out and the joiner in (the leaver admits
    it; the member that stays, now rank 0, hands it the state); nobody is restarted, nothing is trained
    twice, and the leaver's launcher ends with 143 (the first one serves the store until the others end)."""
    out, port = tmp_path / "job", portpicker.pick_unused_port()
    launchers, generation, rank0, rank1 = _two_members(jobs, out, port)
    (leaver,) = [name for name, launcher in launchers.items() if _worker_of(launcher) == rank0]

    def leave():
        launchers[leaver].send_signal(signal.SIGTERM)  # passed to its worker, which is stopped: it waits there
        wait_for(lambda: _signal_pending(rank0, signal.SIGTERM), 10, "the launcher to pass SIGTERM on")

    joiner = _hold_rank0_until(jobs, out, port, launchers, rank0, generation, leave)
    _wait_launchers(out, launchers, {leaver: 143})

    by_step = check_steps(out, epochs=EPOCHS)
    assert exits(out) == {rank0: 143, rank1: 0, joiner: 0}, exits(out)
    members = [(records[0]["generation"], frozenset(r["pid"] for r in records))
               for _, records in sorted(by_step.items())]
    changes = [(a, b) for a, b in zip(members, members[1:]) if a != b]
    assert changes == [((generation, frozenset({rank0, rank1})), (generation + 1, frozenset({rank1, joiner})))], \
        f"not one change from {{{rank0}, {rank1}}} to {{{rank1}, {joiner}}}: {changes}"


@pytest.mark.slow
@pytest.mark.ci_sample
def test_a_join_and_a_kill_at_one_boundary(jobs, tmp_path):
    """A node asks to join while the other member is SIGKILLed, both before rank 0 acts on either: rank 0
    (same PID) re-forms alone, the joiner (same process) asks again and is admitted, the killed worker's
    agent starts it again and it joins as well; at most the step in flight is trained again."""
    out, port = tmp_path / "job", portpicker.pick_unused_port()
    launchers, generation, rank0, rank1 = _two_members(jobs, out, port)
    killed_at = []

    def kill():
        os.kill(rank1, signal.SIGKILL)
        killed_at.append(time.time())

    joiner = _hold_rank0_until(jobs, out, port, launchers, rank0, generation, kill)
    _wait_launchers(out, launchers)

    check_after_rollbacks(out, epochs=EPOCHS)
    after = _check_survivors(out, {rank0}, rank1, killed_at[0])
    assert exits(out).get(joiner) == 0 and any(r["pid"] == joiner and r["world"] > 1 for r in after), \
        f"the joiner {joiner} was not admitted in its own process: {exits(out)}\n{logs(out)}"
    final = {r["pid"] for r in after if r["world"] == 3}
    assert rank0 in final and joiner in final and len(final) == 3, \
        f"the killed worker's replacement did not join: {sorted({(r['pid'], r['world']) for r in after})}"


@pytest.mark.slow
@pytest.mark.ci_sample  # about 15-25 s: CI runs it after the default suite
def test_a_member_lost_as_a_loop_starts_is_left_behind_without_a_rollback(jobs, tmp_path):
    """Rank 1 dies as epoch 4's loader loop is about to start, so rank 0 loses it at that loop's first
    boundary, before the loop trained a step: nothing of the loop was trained, so rank 0 re-forms
    alone with the state the last loop ended with (no restart, nothing trained twice), and the killed
    worker's restart joins it."""
    out, port = tmp_path / "job", portpicker.pick_unused_port()
    launchers, generation, rank0, rank1 = _two_members(jobs, out, port, WORKER_DIE_BEFORE_EPOCH="4:1")
    _wait_launchers(out, launchers)
    (died,) = [json.loads(line) for line in (out / "died.jsonl").read_text().splitlines()]
    assert died["pid"] == rank1
    said = "".join(log.read_text(errors="replace") for log in out.glob("*.log"))
    assert "back to the start of this loop" in said, logs(out)
    check_steps(out, epochs=EPOCHS)  # no step was discarded or trained twice
    after = _check_survivors(out, {rank0}, rank1, died["time"])
    assert min(r["epoch"] for r in after) == 4 and all(r["pid"] != rank1 for r in after)


@pytest.mark.slow
def test_one_of_three_members_lost_while_they_train_flat_out(jobs, tmp_path):
    """Three members train with next to no pause, so the kill lands in a step's gradient all-reduce, its
    noise-scale all-reduce, DDP's buffer broadcast or its agreement as often as not (in the middle of an epoch:
    a loss between loops takes the restart path): the two left keep their PIDs and train again soon (none waits
    out the collective timeout for data that a member which saw the loss first stopped sending), and the
    killed worker's replacement joins them."""
    out, port = tmp_path / "job", portpicker.pick_unused_port()
    settings = dict(SETTINGS, WORKER_STEP_SLEEP="0.01", WORKER_EPOCHS="3", WORKER_BATCH="6",  # 80 steps an epoch
                    WORKER_LOADER_WORKERS="1", WORKER_EVAL="1")  # loader workers, a barrier, validation
    launchers = [launch(jobs, out, port, name, restarts=2, ADAPTIVE_LIVE_MIN="3", **settings)
                 for name in ("first", "second", "third")]
    records = wait_steps(out, lambda rs: any(r["world"] == 3 and r["epoch"] == 1 and r["step"] >= 20 for r in rs),
                         "three members to train into the second epoch")
    pids = {r["rank"]: r["pid"] for r in records if r["world"] == 3}
    loader_workers = [child.pid for child in psutil.Process(pids[1]).children(recursive=True)]
    assert loader_workers, "the killed worker had no DataLoader worker processes"
    killed = time.time()
    os.kill(pids[1], signal.SIGKILL)
    for launcher in launchers:
        assert wait_exit(launcher, 150, out / "first.log") == 0, logs(out)
    check_after_rollbacks(out, epochs=3)
    _check_survivors(out, {pids[0], pids[2]}, pids[1], killed)
    assert live_pids(loader_workers) == [], "the killed worker's DataLoader workers outlived it"


@pytest.mark.slow
@pytest.mark.ci_sample
@pytest.mark.parametrize("moment", ["1", "before-group"])
def test_a_member_lost_while_the_others_re_form(jobs, tmp_path, moment):
    """Of three members one is SIGKILLed; a second one says it lives, builds the new group with the third and
    dies before it meets it there (two kills a few milliseconds apart), or dies once the two agreed on the new
    generation, before they build its group (the third then does not wait in the group's rendezvous).  The member left re-forms again, alone,
    in its process (no restart from the checkpoint), and both killed workers' replacements join it.  The script
    has DataLoader workers, a barrier while rank 0 prepares the data and a validation loop per epoch; the killed
    workers' DataLoader workers are gone with them."""
    out, port = tmp_path / "job", portpicker.pick_unused_port()
    settings = dict(SETTINGS, WORKER_LOADER_WORKERS="1", WORKER_EVAL="1")
    launchers = {name: launch(jobs, out, port, name, restarts=2, ADAPTIVE_LIVE_MIN="3", **settings, **extra)
                 for name, extra in (("first", {}), ("second", {"WORKER_DIE_WHILE_REFORMING": moment}), ("third", {}))}
    records = wait_steps(out, lambda rs: sum(r["world"] == 3 for r in rs) >= 30, "three members to train")
    pids = {r["pid"] for r in records if r["world"] == 3}
    first, second, third = (_worker_of(launchers[name]) for name in ("first", "second", "third"))
    assert pids == {first, second, third}
    loader_workers = [child.pid for pid in (second, third) for child in psutil.Process(pid).children(recursive=True)]
    assert loader_workers, "the killed workers had no DataLoader worker processes"
    killed = time.time()
    os.kill(third, signal.SIGKILL)
    _wait_launchers(out, launchers)
    (died,) = [json.loads(line) for line in (out / "died.jsonl").read_text().splitlines()]
    assert died["pid"] == second and died["time"] > killed
    assert live_pids([second, third]) == []
    assert live_pids(loader_workers) == [], "the killed workers' DataLoader workers outlived them"
    said = "".join(log.read_text(errors="replace") for log in out.glob("*.log"))
    assert "lost another member while re-forming" in said, logs(out)
    check_after_rollbacks(out, epochs=EPOCHS)
    after = _check_survivors(out, {first}, third, killed)
    assert second not in {r["pid"] for r in after if r["time"] > died["time"]}


def _three_members(jobs, out: Path, port: int, **extra: str) -> tuple[dict, dict[int, int]]:
    """Three launchers of one worker each, training together; returns them and the workers' PIDs by rank."""
    launchers = {name: launch(jobs, out, port, name, restarts=2, ADAPTIVE_LIVE_MIN="3", **dict(SETTINGS, **extra))
                 for name in ("first", "second", "third")}
    records = wait_steps(out, lambda rs: sum(r["world"] == 3 for r in rs) >= 15, "three members to train")
    last = max(r["generation"] for r in records if r["world"] == 3)
    return launchers, {r["rank"]: r["pid"] for r in records if r["world"] == 3 and r["generation"] == last}


@pytest.mark.parametrize("step_sleep", ["0.005", pytest.param("0.03", marks=pytest.mark.slow),
                                        pytest.param("0.08", marks=pytest.mark.slow)])
def test_two_members_killed_50_ms_apart(jobs, tmp_path, step_sleep):
    """Of three members two are SIGKILLed 50 ms apart (a lost machine takes several workers, one after the
    other), as they train at several paces (so that the second kill lands in a step, in the re-forming after
    the first, or in the new group's rendezvous): the one left trains again within 30 s (in memory, or from
    the checkpoint if the second loss broke what cannot be discarded), the replacements join it, and every
    launcher ends."""
    out, port = tmp_path / "job", portpicker.pick_unused_port()
    launchers, pids = _three_members(jobs, out, port, WORKER_STEP_SLEEP=step_sleep)
    killed = time.time()
    os.kill(pids[1], signal.SIGKILL)
    time.sleep(0.05)
    os.kill(pids[2], signal.SIGKILL)
    wait_steps(out, lambda rs: any(r["time"] > killed + 0.5 and not r["discarded"] for r in rs),
               "the member left to train again", timeout=30)
    _wait_launchers(out, launchers)
    assert live_pids([pids[1], pids[2]]) == []
    check_after_rollbacks(out, epochs=EPOCHS)


@pytest.mark.slow
@pytest.mark.ci_sample
def test_a_stopped_member_is_named_taken_out_and_started_again(jobs, tmp_path):
    """A worker stopped with SIGSTOP (a hung process: its sockets stay open, so no collective fails) is taken
    out by the others once it gave no sign of life for the hang timeout, named in their log; they train again
    without it in their processes, its launcher kills it (by PID) and starts it again, and the new worker joins
    them; the job ends exact."""
    out, port = tmp_path / "job", portpicker.pick_unused_port()
    launchers, pids = _three_members(jobs, out, port, ADAPTIVE_LIVE_HANG_TIMEOUT="4", WORKER_LOADER_WORKERS="1")
    loader_workers = [child.pid for child in psutil.Process(pids[1]).children(recursive=True)]
    assert loader_workers, "the stopped worker had no DataLoader worker process"
    stopped = time.time()
    os.kill(pids[1], signal.SIGSTOP)
    try:
        records = wait_steps(out, lambda rs: any(r["time"] > stopped + 0.5 and not r["discarded"] and r["world"] == 3
                                                 and r["pid"] not in pids.values() for r in rs),
                             "the stopped worker's replacement to train with the others", timeout=40)
    finally:
        if live_pids([pids[1]]):
            os.kill(pids[1], signal.SIGCONT)
    back = min(r["time"] for r in records if r["time"] > stopped + 0.5 and not r["discarded"])
    assert back - stopped < 4 + 10, f"the others trained again only {back - stopped:.1f} s after the stop"
    assert live_pids([pids[1]] + loader_workers) == [], "the stopped worker or its DataLoader worker was not killed"
    _wait_launchers(out, launchers)
    said = "".join(log.read_text(errors="replace") for log in out.glob("*.log"))
    assert "gave no sign of life" in said and "out as hung; killing it" in said, logs(out)
    assert exits(out)[pids[0]] == 0 and exits(out)[pids[2]] == 0, exits(out)
    assert not any(r["pid"] == pids[1] and r["time"] > stopped for r in steps(out))
    check_after_rollbacks(out, epochs=EPOCHS)
