"""The live job's membership records signed with its secret (adaptive.runtime.signed_records), on an in-process
TCPStore: what verifies, what is ignored (forged, signed with another secret, copied from another key), and the
membership protocol with a secret while a client without it writes every kind of record.

The real launchers and workers with a secret are in ``test_live_secret.py``.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time

import portpicker
import pytest
import torch.distributed as dist

from adaptive.elastic import live_store
from adaptive.runtime import admitting, draining, env, membership, reforming, signed_records
from adaptive.runtime.job import reset_job
from adaptive.runtime.live_protocol import (DRAINS_PENDING_KEY, HUNG, WORKERS_KEY, Generation, GenerationKeys,
                                            Member, agent_key, beat_key, dead_key, drain_key, job_prefix)

from protocol_harness import with_others

SECRET, OTHER = b"unit-test-secret-0123456789abcdef", b"another-secret-0123456789abcdef"
JOB = "signed-unit"
PREFIX = job_prefix(JOB)


def _server(timeout: float = 10.0) -> tuple[dist.TCPStore, int]:
    port = portpicker.pick_unused_port()
    return dist.TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=timeout),
                         wait_for_workers=False), port


def _forger(port: int) -> dist.Store:
    """A client of the job's keys that does not know the secret: it writes raw values."""
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10),
                           wait_for_workers=False)
    return dist.PrefixStore(PREFIX, client)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "adaptive.runtime.signed_records" and r.levelno == logging.WARNING]


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    """Each case sees its own warnings (they are said once per key and process)."""
    monkeypatch.setattr(signed_records, "_warned", set())


# ---------------------------------------------------------------- signing itself
def test_a_record_verifies_only_with_its_secret_its_key_and_its_value():
    key = f"{PREFIX}/dead/3"
    record = signed_records.sign(SECRET, key, "1")
    assert record.startswith(signed_records.MARK) and signed_records.verify(SECRET, key, record) == b"1"
    assert signed_records.verify(SECRET, f"{PREFIX}/dead/4", record) is None  # copied from another key
    assert signed_records.verify(OTHER, key, record) is None  # checked with another secret
    assert signed_records.verify(SECRET, key, signed_records.sign(OTHER, key, "1")) is None  # signed with another
    assert signed_records.verify(SECRET, key, b"1") is None  # not signed
    assert signed_records.verify(SECRET, key, record[:-1] + b"2") is None  # its value changed
    tampered = record[:len(signed_records.MARK)] + b"0" * 64 + record[len(signed_records.MARK) + 64:]
    assert signed_records.verify(SECRET, key, tampered) is None
    assert signed_records.verify(SECRET, key, signed_records.MARK + b"00:1") is None  # too short


def test_a_signed_store_ignores_forged_records_and_names_each_key_once(caplog):
    server, port = _server()
    signed = signed_records.SignedStore(dist.PrefixStore(PREFIX, server), SECRET, PREFIX)
    forger = _forger(port)
    signed.set("gen/1/here/1", "1")
    assert signed.read("gen/1/here/1") == "1" and signed.check(["gen/1/here/1"])
    assert server.get(f"{PREFIX}/gen/1/here/1").startswith(signed_records.MARK)
    forger.set("dead/3", "1")  # written without the secret
    forger.set("dead/4", signed_records.sign(OTHER, f"{PREFIX}/dead/4", "1"))  # with another secret
    forger.set("gen/1/lost", forger.get("gen/1/here/1"))  # a valid record copied from another key
    with caplog.at_level(logging.WARNING, logger="adaptive.runtime.signed_records"):
        for _ in range(3):
            for key in ("dead/3", "dead/4", "gen/1/lost"):
                assert not signed.check([key]) and signed.read(key) is None
        assert not signed.check(["gen/1/here/1", "dead/3"])  # every key must verify
    said = _warnings(caplog)
    assert len(said) == 3, said  # once per key, however often read
    for key in ("dead/3", "dead/4", "gen/1/lost"):
        assert sum(f"'{PREFIX}/{key}'" in line and "fails authentication" in line for line in said) == 1, said
    assert signed.add("beat/1", 2) == 2 and forger.add("beat/1", 1) == 3  # counters are passed through unsigned


def test_compare_set_takes_a_forged_record_for_absent_and_keeps_a_valid_one():
    server, port = _server()
    signed = signed_records.SignedStore(dist.PrefixStore(PREFIX, server), SECRET, PREFIX)
    forger = _forger(port)
    forger.set("gen/1/after_loss", "forged")
    assert signed.compare_set("gen/1/after_loss", "", "mine") == b"mine"
    assert signed.compare_set("gen/1/after_loss", "", "theirs") == b"mine"  # the first valid one stands
    assert signed.read("gen/1/after_loss") == "mine"
    assert signed.compare_set("gen/1/next", "", "first") == b"first"
    with pytest.raises(ValueError, match="expected_value must be ''"):
        signed.compare_set("gen/1/next", "first", "second")


def test_a_blocking_get_waits_past_a_forged_record_for_a_valid_one():
    server, port = _server(timeout=1.0)
    signed = signed_records.SignedStore(dist.PrefixStore(PREFIX, server), SECRET, PREFIX)
    forger = _forger(port)
    forger.set("gen/1/go", "1")
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="passes authentication"):
        signed.get("gen/1/go")
    assert time.monotonic() - started < 3.0
    writer = threading.Timer(0.3, lambda: signed.set("gen/1/go", "1"))
    writer.start()
    try:
        assert signed.get("gen/1/go") == b"1"
    finally:
        writer.join()


def test_without_a_secret_the_job_store_is_the_plain_store(monkeypatch):
    monkeypatch.delenv(env.LIVE_SECRET_VAR, raising=False)
    monkeypatch.delenv(env.LIVE_SECRET_FILE_VAR, raising=False)
    server, _ = _server()
    assert signed_records.wrap(server) is server
    assert not signed_records.is_signed(membership.job_store(server, JOB))
    monkeypatch.setenv(env.LIVE_SECRET_VAR, SECRET.decode())
    assert signed_records.is_signed(membership.job_store(server, JOB))
    assert not signed_records.is_signed(membership.job_store(server, JOB, signed=False))  # the groups' rendezvous


def test_the_secret_comes_from_the_environment_or_a_file(monkeypatch, tmp_path):
    monkeypatch.delenv(env.LIVE_SECRET_VAR, raising=False)
    monkeypatch.delenv(env.LIVE_SECRET_FILE_VAR, raising=False)
    assert env.live_secret() is None
    monkeypatch.setenv(env.LIVE_SECRET_VAR, "0123456789abcdef")
    assert env.live_secret() == b"0123456789abcdef"
    path = tmp_path / "secret"
    path.write_text("from-a-file-0123456789\n")
    monkeypatch.setenv(env.LIVE_SECRET_FILE_VAR, str(path))
    with pytest.raises(ValueError, match="both set"):
        env.live_secret()
    monkeypatch.delenv(env.LIVE_SECRET_VAR)
    assert env.live_secret() == b"from-a-file-0123456789"
    path.write_text("short\n")
    with pytest.raises(ValueError, match="at least 16 characters"):
        env.live_secret()
    monkeypatch.setenv(env.LIVE_SECRET_FILE_VAR, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=env.LIVE_SECRET_FILE_VAR):
        env.live_secret()


# ---------------------------------------------------------------- the protocol with a secret
@pytest.fixture
def member(monkeypatch):
    """A signed job's store on 127.0.0.1 and this process formed alone into generation 1; yields the job's keys
    (signed) and a client of them without the secret."""
    server, port = _server()
    monkeypatch.setenv(env.LIVE_STORE_VAR, f"127.0.0.1:{port}")
    monkeypatch.setenv("ADAPTIVE_JOB_ID", JOB)
    monkeypatch.setenv("ADAPTIVE_LIVE_HANG_TIMEOUT", "10")
    monkeypatch.delenv(env.LIVE_SECRET_FILE_VAR, raising=False)
    monkeypatch.setenv(env.LIVE_SECRET_VAR, SECRET.decode())
    reset_job()
    try:
        assert membership.join(10.0) is not None
        store = membership.membership().store
        assert store is not None and signed_records.is_signed(store)
        yield store, _forger(port)
    finally:
        reset_job()
        del server


def test_forged_reports_of_a_loss_a_death_or_a_hang_change_nothing(member):
    store, forger = member
    other = Member(201, 2, 0)
    current = with_others(store, other)
    forger.set(current.keys.lost, "1")
    forger.set(dead_key(other.wid), signed_records.sign(OTHER, f"{PREFIX}/{dead_key(other.wid)}", HUNG))
    store.set(dead_key(999), "1")  # a valid record of another worker, copied to this one's key below
    forger.set(dead_key(other.wid + 1), forger.get(dead_key(999)))
    for _ in range(3):
        forger.add(beat_key(other.wid), 1)  # a forged sign of life only makes it look alive
        assert not reforming.loss_reported() and not membership.is_dead(other)
        time.sleep(reforming.HANG_CHECK_INTERVAL)
    assert not membership.is_dead(Member(other.wid + 1, 2, 1))
    store.set(dead_key(other.wid), "1")  # its launcher's own report
    time.sleep(reforming.HANG_CHECK_INTERVAL)
    assert reforming.loss_reported() and membership.is_dead(other)


def test_a_forged_join_request_is_neither_counted_nor_admitted(member):
    store, forger = member
    keys = GenerationKeys(1)
    forger.add(keys.joins, 2)
    forger.set(keys.join(1), Member(301, 9, 0).to_json())
    forger.set(keys.join_waiting(1), repr(time.time()))
    forger.set(keys.join(2), signed_records.sign(OTHER, f"{PREFIX}/{keys.join(2)}", Member(302, 9, 0).to_json()))
    forger.set(keys.join_waiting(2), signed_records.sign(OTHER, f"{PREFIX}/{keys.join_waiting(2)}",
                                                         repr(time.time())))
    assert admitting.pending_joins() == 0
    me = membership.membership().wid
    following = admitting.close_generation([me], joins=2)
    assert [m.wid for m in following.members] == [me] and following.joiners == ()


def test_a_forged_drain_request_drains_no_node(member):
    store, forger = member
    with_others(store, Member(201, 2, 0))
    forger.add(DRAINS_PENDING_KEY, 1)
    forger.set(drain_key(2), repr(time.time()))
    assert draining.pending_drains(store) == 0 and not draining.is_drained(store, 2)
    draining.request_drain(store, 2)  # the operator's, signed: it replaces the forged one
    assert draining.pending_drains(store) == 1 and draining.is_drained(store, 2)


def test_forged_answers_while_re_forming_are_ignored(member):
    store, forger = member
    other = Member(201, 2, 0)
    current = with_others(store, other)
    me = membership.membership().me()
    forger.set(current.keys.alive(other.wid), "1")  # it did not say it lives
    forger.set(current.keys.after_loss, Generation(3, (other,)).to_json())  # a proposal without this member
    forger.set(current.keys.next, Generation(3, (other,)).to_json())
    agreed = reforming.reform_after_loss(timeout=1.0)
    assert agreed is not None and agreed.members == (me,) and agreed.number == 3
    assert Generation.from_json(store.get(current.keys.after_loss)) == agreed
    following = Generation(4, (me, other))
    forger.set(following.keys.here(other.wid), "1")  # it is not there
    assert reforming.meet(following, timeout=1.0) == [other.wid]


def test_an_old_sign_of_life_written_back_does_not_take_a_live_node_for_lost(member):
    store, _ = member
    agents = membership.membership().agents
    assert agents is not None and signed_records.is_signed(agents)
    other = Member(201, 2, 0)
    with_others(store, other)
    store.add(beat_key(other.wid), 1)
    old = repr(time.time() - 60)
    agents.set(agent_key(2), old)  # a valid record of that launcher, written back by someone who read it
    assert not membership.is_dead(other)  # stale, but not seen unchanged yet
    agents.set(agent_key(2), repr(time.time()))  # its launcher renews it
    assert not membership.is_dead(other)
    agents.set(agent_key(2), old)
    assert not membership.is_dead(other)  # it changed: a live launcher's
    time.sleep(membership.AGENT_UNCHANGED + 0.2)
    store.add(beat_key(other.wid), 1)
    assert membership.is_dead(other)  # unchanged for that long: the launcher is gone
    agents.set(agent_key(2), "done")
    assert membership.is_dead(other)


def test_a_counter_set_back_hands_out_no_worker_id_twice(member):
    store, forger = member
    mine = membership.membership().wid
    forger.add(WORKERS_KEY, -1)  # the next add would hand out this worker's id again
    assert membership._worker_id(store) == mine + 1


# ---------------------------------------------------------------- the launchers
def test_a_launcher_with_another_secret_or_none_is_refused(monkeypatch, caplog):
    monkeypatch.delenv(env.LIVE_SECRET_FILE_VAR, raising=False)
    server, _ = _server()
    mine = live_store.JobIdentity("train", "none", "train.py", ())
    monkeypatch.setenv(env.LIVE_SECRET_VAR, SECRET.decode())
    live_store.claim_identity(server, mine)
    live_store.claim_identity(server, mine)  # the same job, the same secret: welcome
    monkeypatch.setenv(env.LIVE_SECRET_VAR, OTHER.decode())
    with pytest.raises(live_store.IdentityMismatch) as refused, caplog.at_level(logging.ERROR):
        live_store.claim_identity(server, mine)
    assert refused.value.code == live_store.CONFIG_ERROR_EXIT_CODE and "another secret" in caplog.text
    monkeypatch.delenv(env.LIVE_SECRET_VAR)
    with pytest.raises(live_store.IdentityMismatch):
        live_store.claim_identity(server, mine)
    assert "signs its records with a secret" in caplog.text
    unsigned, _ = _server()
    live_store.claim_identity(unsigned, mine)
    monkeypatch.setenv(env.LIVE_SECRET_VAR, SECRET.decode())
    with pytest.raises(live_store.IdentityMismatch):  # a job without a secret: this launcher's has one
        live_store.claim_identity(unsigned, mine)


def test_a_store_other_machines_reach_without_a_secret_is_named_in_one_warning(monkeypatch, caplog):
    monkeypatch.delenv(env.LIVE_SECRET_VAR, raising=False)
    monkeypatch.delenv(env.LIVE_SECRET_FILE_VAR, raising=False)
    assert live_store.is_loopback("127.0.0.1") and live_store.is_loopback("localhost")
    assert not live_store.is_loopback("192.0.2.1")
    with caplog.at_level(logging.WARNING, logger="adaptive.elastic.live_store"):
        live_store.warn_if_unsigned("127.0.0.1", 29400)
        assert not caplog.records
        live_store.warn_if_unsigned("192.0.2.1", 29400)
        (said,) = [r.getMessage() for r in caplog.records]
        assert "192.0.2.1:29400 has no secret" in said and env.LIVE_SECRET_VAR in said
        monkeypatch.setenv(env.LIVE_SECRET_VAR, SECRET.decode())
        live_store.warn_if_unsigned("192.0.2.1", 29400)
    assert len(caplog.records) == 1


def test_the_schedulers_live_backends_give_each_launch_its_own_secret():
    from scheduler.executor.jobspec import JobSpec
    from scheduler.executor.local_live import LiveLocalHandle, secret_environment

    spec = JobSpec(name="job", command=("train.py",), checkpoint_dir="/tmp/unused")
    first, second = LiveLocalHandle(spec, 1, 0), LiveLocalHandle(spec, 1, 1)
    assert len(first.secret) == 64 and first.secret != second.secret
    assert first.secret not in repr(first)
    given = secret_environment(first.secret)
    assert given == {env.LIVE_SECRET_VAR: first.secret, env.LIVE_SECRET_FILE_VAR: ""}


def test_the_ray_live_backend_hands_every_replica_of_a_launch_the_same_secret(tmp_path):
    """``LiveRayBackend._place`` (no cluster: ``launch_nodes`` is recorded): every replica of one launch gets the
    launch's secret in its environment, a new launch another; the job's own spec is left as it was."""
    from scheduler.executor.jobspec import JobSpec
    from scheduler.executor.ray_live import LiveRayBackend, LiveRayHandle, Replica

    backend = LiveRayBackend(str(tmp_path / "logs"), pool=object())
    given: list[dict[str, str]] = []

    class Recorder:
        def launch_nodes(self, spec, *args, **kwargs):
            given.append(dict(spec.env))
            return None

    backend.ray_backend = Recorder()
    spec = JobSpec(name="live", command=("train.py",), checkpoint_dir=str(tmp_path / "ckpt"), max_replicas=3,
                   env={"OMP_NUM_THREADS": "1"})
    first, second = LiveRayHandle(spec, 1, replicas=[Replica(0, 0), Replica(1, 1)]), LiveRayHandle(spec, 2)
    second.replicas = [Replica(0, 0)]
    for handle in (first, second):
        for replica in handle.replicas:
            backend._place(handle, replica)
    assert [env_.get(env.LIVE_SECRET_VAR) for env_ in given] == [first.secret, first.secret, second.secret]
    assert first.secret != second.secret and all(env_[env.LIVE_SECRET_FILE_VAR] == "" for env_ in given)
    assert given[0]["OMP_NUM_THREADS"] == "1" and env.LIVE_SECRET_VAR not in spec.env
