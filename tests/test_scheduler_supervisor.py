"""Supervisor: real HTTP on a free port, token, validation, persistence, allocation rounds."""

import http.client
import json
import os
import stat

import portpicker
import pytest

from scheduler.allocator import Allocator
from scheduler.cluster import ClusterSpec
from scheduler.policies import GoodputPolicy, TiresiasPolicy
from scheduler.supervisor import (MAX_BODY_BYTES, SupervisorClient, SupervisorError, SupervisorServer,
                                  SupervisorState)
from scheduler.supervisor.__main__ import load_or_create_token

TOKEN = "s3cret-token-for-tests-0123456789"


def hints(job_id="job-a", **changes):
    data = {
        "version": 2, "job_id": job_id, "timestamp": 1.0, "init_batch_size": 128, "max_batch_size": 4096,
        "local_bsz_bounds": [32, 1024], "gradient_accumulation": True,
        "perf_params": {"alpha_c": 0.02, "beta_c": 0.0006, "alpha_n": 0.1, "beta_n": 0.002,
                        "alpha_r": 0.01, "beta_r": 0.001, "gamma": 1.2},
        "grad_params": {"sqr": 1.0, "var": 20.0}, "max_profiled_replicas": 2, "max_profiled_nodes": 1,
        "progress": 10.0, "current": {"num_nodes": 1, "num_replicas": 2, "local_bsz": 64, "accum_steps": 1},
        "completed_fraction": None,
    }
    data.update(changes)
    return data


@pytest.fixture
def served(tmp_path):
    state = SupervisorState(str(tmp_path / "state.json"))
    server = SupervisorServer(state, TOKEN, port=portpicker.pick_unused_port()).start()
    try:
        yield state, server, SupervisorClient(server.url, TOKEN)
    finally:
        server.stop()


def raw(server, method, path, body=None, headers=None):
    """A request with full control over headers; returns (status, parsed JSON or None)."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, (json.loads(data) if data else None)
    finally:
        conn.close()


def auth(extra=None):
    return {"Authorization": f"Bearer {TOKEN}", **(extra or {})}


def test_binds_to_loopback_and_health_needs_no_token(served):
    _, server, client = served
    assert server.host == "127.0.0.1"
    assert client.health()
    assert raw(server, "GET", "/v1/health") == (200, {"status": "ok"})


@pytest.mark.parametrize("header", [None, "Bearer wrong-token-wrong-token", "Basic " + TOKEN, "Bearer"])
def test_token_is_required(served, header):
    _, server, _ = served
    headers = {"Authorization": header} if header else {}
    status, body = raw(server, "GET", "/v1/jobs", headers=headers)
    assert status == 401 and "token" in body["error"]
    with pytest.raises(SupervisorError) as err:
        SupervisorClient(server.url, "not-the-token-at-all").jobs()
    assert err.value.status == 401


def test_hints_round_trip_and_allocation(served):
    state, _, client = served
    client.register_job("job-a", min_replicas=1, max_replicas=8)
    client.post_hints("job-a", hints())
    assert client.get_hints("job-a")["grad_params"] == {"sqr": 1.0, "var": 20.0}
    assert client.get_allocation("job-a") == ((), 0)
    Allocator(GoodputPolicy(), ClusterSpec(1, 4), state).step(now=100.0)
    allocation, version = client.get_allocation("job-a")
    assert len(allocation) == 4 and version == 1  # 2 profiled replicas, explores 4x: all 4 GPUs
    assert client.jobs()["job-a"]["allocation"] == list(allocation)


def test_posted_completed_fraction_gives_the_policy_the_remaining_work(served):
    state, _, client = served
    for job_id, fraction in (("early", 0.1), ("late", 0.9), ("undeclared", None)):
        client.register_job(job_id, max_replicas=4)
        client.post_hints(job_id, hints(job_id, completed_fraction=fraction))
    allocator = Allocator(GoodputPolicy(), ClusterSpec(1, 4), state)
    infos = {job_id: allocator.job_info(record) for job_id, record in state.jobs().items()}
    assert infos["undeclared"].remaining_work is None
    # Same progress (10 reference steps): 9x it left at 10% done, 1/9 of it at 90%.
    assert infos["early"].remaining_work == pytest.approx(81 * infos["late"].remaining_work)


def test_hints_of_the_previous_format_are_accepted_and_stored_in_the_current_one(served):
    """A job of the previous release posts format 1 (no completed_fraction): stored as format 2 with null."""
    _, _, client = served
    client.register_job("job-a", max_replicas=4)
    old = {key: value for key, value in hints(version=1).items() if key != "completed_fraction"}
    client.post_hints("job-a", old)
    assert client.get_hints("job-a") == hints()
    client.post_hints("job-a", hints(completed_fraction=0.5))
    assert client.get_hints("job-a")["completed_fraction"] == 0.5


def test_unknown_jobs_are_rejected(served):
    _, server, client = served
    with pytest.raises(SupervisorError) as err:
        client.post_hints("ghost", hints("ghost"))
    assert err.value.status == 404 and "unknown job id" in err.value.message
    assert raw(server, "GET", "/v1/jobs/ghost/allocation", headers=auth())[0] == 404
    assert raw(server, "DELETE", "/v1/jobs/ghost", headers=auth())[0] == 404


@pytest.mark.parametrize("body, message", [
    (hints(progress="fast"), "progress"),
    (hints(perf_params={"alpha_c": 1.0}), "perf_params"),
    (hints(extra_field=1), "unknown fields"),
    (hints(job_id="job-b"), "does not match"),
    (hints(local_bsz_bounds=[64, 32]), "local_bsz_bounds"),
    (hints(completed_fraction=1.5), "completed_fraction"),
    ([1, 2, 3], "JSON object"),
])
def test_bad_hints_get_400_naming_the_problem(served, body, message):
    _, _, client = served
    client.register_job("job-a", max_replicas=4)
    with pytest.raises(SupervisorError) as err:
        client.post_hints("job-a", body) if isinstance(body, dict) else client._request(
            "POST", "/v1/jobs/job-a/hints", body)
    assert err.value.status == 400 and message in err.value.message


def test_transport_level_limits(served):
    _, server, client = served
    client.register_job("job-a", max_replicas=4)
    big = json.dumps(hints(job_id="job-a" + "x" * MAX_BODY_BYTES))
    status, body = raw(server, "POST", "/v1/jobs/job-a/hints", big, auth({"Content-Type": "application/json"}))
    assert status == 413 and "limit" in body["error"]
    status, body = raw(server, "POST", "/v1/jobs/job-a/hints", json.dumps(hints()), auth({"Content-Type": "text/plain"}))
    assert status == 415
    status, body = raw(server, "POST", "/v1/jobs/job-a/hints", "{not json", auth({"Content-Type": "application/json"}))
    assert status == 400 and "not valid JSON" in body["error"]
    assert raw(server, "GET", "/v1/jobs/bad%20id/allocation", headers=auth())[0] == 400
    assert raw(server, "GET", "/v1/nowhere", headers=auth())[0] == 404
    assert raw(server, "PATCH", "/v1/jobs/job-a", headers=auth())[0] == 405
    assert raw(server, "POST", "/v1/jobs/job-a/allocation", "{}", auth({"Content-Type": "application/json"}))[0] == 405


def test_registration_is_validated(served):
    _, _, client = served
    for spec, message in [({"max_replicas": 0}, "max_replicas"), ({"min_replicas": -1}, "min_replicas"),
                          ({"preemptible": "yes"}, "preemptible"), ({"gpus": 2}, "unknown job spec field")]:
        with pytest.raises(SupervisorError) as err:
            client._request("PUT", "/v1/jobs/job-a", spec)
        assert err.value.status == 400 and message in err.value.message


def test_state_survives_a_restart(tmp_path):
    path = str(tmp_path / "state.json")
    state = SupervisorState(path)
    with SupervisorServer(state, TOKEN, port=portpicker.pick_unused_port()) as server:
        client = SupervisorClient(server.url, TOKEN)
        client.register_job("job-a", max_replicas=2, submission_time=5.0)
        client.post_hints("job-a", hints())
        Allocator(TiresiasPolicy(), ClusterSpec(1, 4), state).step(now=10.0)
    assert json.load(open(path))["jobs"]["job-a"]["allocation"] == [0, 0]
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    revived = SupervisorState(path)
    with SupervisorServer(revived, TOKEN, port=portpicker.pick_unused_port()) as server:
        client = SupervisorClient(server.url, TOKEN)
        assert client.get_allocation("job-a") == ((0, 0), 1)
        assert client.get_hints("job-a") == hints()
        assert client.jobs()["job-a"]["submission_time"] == 5.0
    revived.set_allocations({}, now=70.0)
    assert SupervisorState(path).job("job-a").attained_service == pytest.approx(2 * 60.0)


def test_corrupt_state_file_is_an_error(tmp_path):
    path = tmp_path / "state.json"
    path.write_text("{half")
    with pytest.raises(ValueError, match="not valid JSON"):
        SupervisorState(str(path))
    path.write_text(json.dumps({"version": 99}))
    with pytest.raises(ValueError, match="not a supervisor state file"):
        SupervisorState(str(path))


def test_short_tokens_are_refused_and_new_tokens_are_private(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="at least 16"):
        SupervisorServer(SupervisorState(), "short")
    monkeypatch.delenv("SCHEDULER_TOKEN", raising=False)
    state_path = str(tmp_path / "state.json")
    token = load_or_create_token(None, state_path)
    assert len(token) >= 32
    assert stat.S_IMODE(os.stat(state_path + ".token").st_mode) == 0o600
    assert load_or_create_token(None, state_path) == token
