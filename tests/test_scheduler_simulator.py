"""Trace simulator: time accounting, restarts, completion, reproduction of published results."""

import json
import os
import subprocess
import sys

import pytest

from scheduler.cluster import ClusterSpec
from scheduler.policies import TiresiasPolicy
from scheduler.profiles import ModelProfile, ModelSettings
from scheduler.simulate import main as simulate_main
from scheduler.simulate import run_simulation
from scheduler.sim.simulator import Simulator
from scheduler.sim.workload import WorkloadJob
from tests.test_scheduler_profiles import write_trace

# A model whose step takes 0.5 s at any batch and whose gain is always 1
# (no gradient noise): progress advances by 2 per second on one GPU.
CONSTANT = dict(placements=[("1", 10, 0.5, 0.0), ("1", 30, 0.5, 0.0)],
                validation={10: [(100.0, 1.0, 0.0), (200.0, 1.0, 0.0)]})


@pytest.fixture
def toy(tmp_path):
    return {"toy": ModelProfile("toy", write_trace(str(tmp_path), **CONSTANT))}


def job(name, time=0.0, replicas=1, batch=10):
    return WorkloadJob(name, time, "toy", replicas, batch)


def test_single_job_waits_for_round_pays_restart_then_runs(toy):
    sim = Simulator([job("a", time=10)], toy, TiresiasPolicy(), ClusterSpec(1, 1))
    result = sim.run()
    # Scheduled at t=60, restart until 90, 200 progress at 2/s -> done at 190.
    assert result.jct == {"a": pytest.approx(180.0)}
    assert result.makespan == pytest.approx(180.0)
    assert result.restarts == {"a": 0}


def test_completion_after_fixed_epochs(tmp_path):
    prof = ModelProfile("toy", write_trace(str(tmp_path), **CONSTANT), ModelSettings(max_epochs=1))
    result = Simulator([job("a")], {"toy": prof}, TiresiasPolicy(), ClusterSpec(1, 1)).run()
    assert result.jct["a"] == pytest.approx(30 + 50)


def test_preemption_and_restart_penalties_are_accounted(toy):
    policy = TiresiasPolicy(queue_threshold=50)
    result = Simulator([job("a"), job("b")], toy, policy, ClusterSpec(1, 1)).run()
    # a: 0-30 restart, 30-60 work; demoted, b runs 60-120 (30 s work); a resumes
    # 120-150 restart, 150-180 work, then keeps running and ends at 220; b restarts
    # at 240 and needs 70 s more after its 30 s restart: 340.
    assert result.jct == {"a": pytest.approx(220.0), "b": pytest.approx(340.0)}
    assert result.restarts == {"a": 1, "b": 1}


def test_larger_batch_on_more_gpus_progresses_faster(tmp_path):
    placements = [("1", 10, 0.5, 0.0), ("1", 30, 0.5, 0.0), ("2", 5, 0.5, 0.1), ("2", 30, 0.5, 0.1)]
    noisy = {10: [(100.0, 1.0, 1.0), (200.0, 1.0, 1.0)], 20: [(100.0, 1.0, 1.0), (200.0, 1.0, 1.0)]}
    prof = ModelProfile("toy", write_trace(str(tmp_path), placements=placements, validation=noisy))
    profiles = {"toy": prof}
    one = Simulator([job("a")], profiles, TiresiasPolicy(), ClusterSpec(1, 2)).run()
    two = Simulator([job("a", replicas=2, batch=20)], profiles, TiresiasPolicy(), ClusterSpec(1, 2)).run()
    assert one.jct["a"] == pytest.approx(30 + 200 / (1 / 0.5))
    # Batch 20 = scale 2: gain (1 + 1) / (1 / 2 + 1) = 4/3 per 0.5 s step.
    assert two.jct["a"] == pytest.approx(30 + 200 / ((4 / 3) / 0.5))
    with pytest.raises(ValueError, match="more GPUs than the cluster"):
        Simulator([job("a", replicas=3)], profiles, TiresiasPolicy(), ClusterSpec(1, 2))


def test_unknown_application_and_bad_settings_are_rejected(toy):
    with pytest.raises(ValueError, match="no profile"):
        Simulator([WorkloadJob("a", 0, "other", 1, 1)], toy, TiresiasPolicy())
    with pytest.raises(ValueError, match="interval"):
        Simulator([job("a")], toy, TiresiasPolicy(), interval=0)
    with pytest.raises(ValueError, match="restart_penalty"):
        Simulator([job("a")], toy, TiresiasPolicy(), restart_penalty=-1)


PUBLISHED_TIRESIAS = {1: 2474, 2: 5145, 3: 3876, 4: 3280, 5: 3501}


@pytest.mark.parametrize("workload", sorted(PUBLISHED_TIRESIAS))
def test_tiresias_reproduces_published_average_jct(workload):
    result = run_simulation(f"workload-{workload}", "tiresias")
    assert result.jobs == 160
    assert result.avg_jct == pytest.approx(PUBLISHED_TIRESIAS[workload], rel=0.05)


def test_runs_are_deterministic():
    a = run_simulation("workload-3", "tiresias").jct
    b = run_simulation("workload-3", "tiresias").jct
    assert a == b


def test_cli_writes_json(tmp_path, capsys):
    out = tmp_path / "res" / "w.json"
    assert simulate_main(["workload-1", "--policy", "tiresias", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {"avg_jct", "p99_jct", "makespan", "jobs", "policy", "jct"} <= set(data)
    assert data["policy"] == "tiresias" and data["jobs"] == 160 and len(data["jct"]) == 160
    assert "avg JCT" in capsys.readouterr().out
    assert simulate_main(["no-such-workload", "--policy", "tiresias"]) == 2
    assert "workload not found" in capsys.readouterr().err


def test_package_api_is_light_and_does_not_shadow_the_cli():
    import scheduler
    assert all(hasattr(scheduler, name) for name in scheduler.__all__)
    assert scheduler.run_simulation is run_simulation
    code = ("import sys, scheduler; "
            "assert not [m for m in sys.modules if m.startswith(('scheduler.supervisor', 'scheduler.executor'))]")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-W", "error", "-c", code], check=True, cwd=repo)
    # Importing the package must not import the CLI module that ``-m`` runs (runpy warns otherwise).
    subprocess.run([sys.executable, "-W", "error", "-m", "scheduler.simulate", "--help"], check=True, cwd=repo,
                   stdout=subprocess.DEVNULL)
