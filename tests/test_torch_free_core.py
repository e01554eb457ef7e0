"""The torch-free core imports and works where torch cannot be imported.

The cluster side (``scheduler``, the trace simulator) and the pure parts of
the library (``adaptive.goodput``: the goodput model, its fit, the hints;
the sampler, the token planner, the ramp-up schedules) must run on a
machine without PyTorch. Each test runs a fresh interpreter in which
``import torch`` fails: a ``sitecustomize`` on a folder put first on
``PYTHONPATH`` installs a meta-path finder that raises
``ModuleNotFoundError`` for ``torch`` and every ``torch.*`` module, as a
Python without torch would. Names are imported through the package faces
(``adaptive.goodput``, ``adaptive.batchsize``, ``adaptive.data``,
``adaptive.data.tokens``), so the tests hold whichever module behind a face
defines them.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

BLOCKER = '''
import sys


class _NoTorch:
    """Finds nothing for torch: every ``import torch...`` fails as if torch were not installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NoTorch())
'''

# Run in every child after its checks: torch was neither importable nor imported.
EPILOGUE = '''
import sys as _sys
assert not any(m == "torch" or m.startswith("torch.") for m in _sys.modules), "torch was imported"
try:
    import torch  # noqa: F401
except ImportError:
    pass
else:
    raise AssertionError("the torch blocker did not work")
print("TORCH-FREE-OK")
'''


@pytest.fixture(scope="module")
def no_torch_env(tmp_path_factory) -> dict[str, str]:
    """Environment for a child interpreter in which ``import torch`` fails."""
    folder = tmp_path_factory.mktemp("no_torch")
    (folder / "sitecustomize.py").write_text(BLOCKER, encoding="utf-8")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(folder), str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH")
                                                                       else []))
    env.pop("PYTHONSTARTUP", None)
    return env


def run_without_torch(env: dict[str, str], code: str, *args: str, module: str | None = None,
                      cwd: Path = REPO, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``code`` (or ``python -m module args``) in a child where torch cannot be imported."""
    command = [sys.executable, "-m", module, *args] if module else [sys.executable, "-c",
                                                                      textwrap.dedent(code) + EPILOGUE]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def check(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result.stdout


def test_the_blocker_blocks_torch(no_torch_env):
    out = check(run_without_torch(no_torch_env, """
        try:
            import torch.nn
        except ModuleNotFoundError as error:
            assert error.name in ("torch", "torch.nn"), error.name
        else:
            raise AssertionError("torch imported")
    """))
    assert "TORCH-FREE-OK" in out


def test_packages_and_faces_import_without_torch(no_torch_env):
    check(run_without_torch(no_torch_env, """
        import adaptive
        import scheduler
        import adaptive.batchsize
        import adaptive.data
        import adaptive.data.tokens
        import adaptive.goodput
        import adaptive.goodput.hints
        import adaptive.goodput.model
        import adaptive.batchsize.rampup
        import adaptive.data.sampler
        from scheduler import ClusterSpec, make_policy, run_simulation  # noqa: F401
        assert adaptive.__version__
        assert "run_simulation" in scheduler.__all__
        # subpackages are attributes of the top-level face, imported on first use
        assert adaptive.batchsize.GoodputFunction is adaptive.goodput.model.GoodputFunction
        assert adaptive.goodput.GoodputFunction is adaptive.batchsize.GoodputFunction
        assert "parallel" in dir(adaptive) and "goodput" in dir(adaptive)
    """))


def test_subpackages_are_reachable_from_import_adaptive():
    import subprocess
    import sys

    code = ("import sys, adaptive; assert 'adaptive.parallel' not in sys.modules; "
            "assert adaptive.parallel.sharding_mesh is adaptive.parallel._sharding.sharding_mesh; "
            "assert adaptive.runtime.env is adaptive.env; print('OK')")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr


def test_the_shared_models_and_the_simulator_load_no_torch(no_torch_env):
    """``adaptive.goodput`` (every module and every public name) and the scheduler's simulator
    import without torch, and the shared package pulls in no torch-side part of ``adaptive.batchsize``."""
    check(run_without_torch(no_torch_env, """
        import importlib
        import pkgutil
        import sys

        import adaptive.goodput

        modules = [info.name for info in pkgutil.walk_packages(adaptive.goodput.__path__, "adaptive.goodput.")]
        assert {"adaptive.goodput.model", "adaptive.goodput.fit", "adaptive.goodput.hints",
                "adaptive.goodput.noise_estimate", "adaptive.goodput.search"} <= set(modules), modules
        for name in modules:
            importlib.import_module(name)
        for name in adaptive.goodput.__all__:
            assert getattr(adaptive.goodput, name) is not None, name
        # apart from the job side: no batch-size control, step control or model wrapper is loaded
        job_side = sorted(m for m in sys.modules if m.startswith(("adaptive.batchsize.", "adaptive.elastic.",
                                                                  "adaptive.parallel.", "adaptive.data.")))
        assert not job_side, job_side

        import scheduler.simulate
        import scheduler.sim.job
        import scheduler.sim.simulator
        import scheduler.sim.workload
        from scheduler import run_simulation  # noqa: F401
    """))


def test_the_scheduler_imports_only_public_adaptive_modules():
    """The cluster side uses the library through public names (``adaptive.goodput``, ...), never a private module."""
    private = []
    for path in sorted((REPO / "scheduler").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names += [f"{node.module}.{alias.name}" for alias in node.names]
            private += [f"{path.relative_to(REPO)}: {name}" for name in names
                        if name.split(".")[0] == "adaptive" and any(part.startswith("_") for part in name.split("."))]
    assert not private, private


def test_goodput_model_works_without_torch(no_torch_env):
    check(run_without_torch(no_torch_env, """
        import numpy as np
        from adaptive.goodput import GoodputFunction, GradParams, PerfParams

        perf = PerfParams(0.02, 0.001, 0.08, 0.01, 0.03, 0.004, 2.0)
        grad = GradParams(0.5, 12.0)
        fn = GoodputFunction(perf, grad, 128)
        one = fn.evaluate(1, 1, 128, 1)
        assert np.isfinite(one) and one > 0
        many = fn.evaluate(1, np.array([1, 2, 4]), 128, 1)
        assert np.shape(many) == (3,) and np.all(many > 0)
        goodput, local_bsz, accum_steps = fn.optimize(1, 4, max_batch_size=4096, local_bsz_bounds=(16, 512),
                                                      gradient_accumulation=True)
        assert goodput > 0 and 16 <= int(np.asarray(local_bsz).max()) <= 512 and int(np.asarray(accum_steps).min()) >= 1
        assert 0 < fn.efficiency(1024) <= 1
    """))


def test_hints_round_trip_without_torch(no_torch_env, tmp_path):
    check(run_without_torch(no_torch_env, f"""
        import json
        from adaptive.goodput import Hints, read_hints, write_hints

        document = {{
            "version": 1, "job_id": "job-1", "timestamp": 1767225600.5, "init_batch_size": 128,
            "max_batch_size": 4096, "local_bsz_bounds": [16, 512], "gradient_accumulation": True,
            "perf_params": {{"alpha_c": 0.02, "beta_c": 0.001, "alpha_n": 0.08, "beta_n": 0.01, "alpha_r": 0.03,
                            "beta_r": 0.004, "gamma": 2.0}},
            "grad_params": {{"sqr": 0.5, "var": 12.0}},
            "max_profiled_replicas": 4, "max_profiled_nodes": 1, "progress": 321.5,
            "current": {{"num_nodes": 1, "num_replicas": 4, "local_bsz": 64, "accum_steps": 2}},
        }}
        hints = Hints.from_json(json.dumps(document))  # format 1 (the previous release), migrated
        assert hints.completed_fraction is None and hints.state_dict()["version"] == 2
        path = write_hints(hints, {str(tmp_path)!r})
        assert read_hints(path) == hints
        assert read_hints({str(tmp_path)!r}) == hints
        assert hints.goodput_function().init_batch_size == 128
        current = Hints.from_json(json.dumps(dict(document, version=2, completed_fraction=0.5)))
        assert read_hints(write_hints(current, {str(tmp_path)!r})).completed_fraction == 0.5
    """))


def test_sampler_gives_permutations_without_torch(no_torch_env):
    check(run_without_torch(no_torch_env, """
        import numpy as np
        from adaptive.data import ElasticSampler, GlobalPermutation

        for n in (10, 1024, 5000):  # an explicit table up to 1024, a Feistel network above
            perm = GlobalPermutation(n, seed=3, epoch=1)
            order = np.asarray(perm.take(0, n))
            assert sorted(order.tolist()) == list(range(n)), n
            assert [perm[i] for i in range(5)] == order[:5].tolist()
            assert GlobalPermutation(n, seed=3, epoch=1).take(0, n).tolist() == order.tolist()  # seeded
        assert GlobalPermutation(5000, seed=3, epoch=2).take(0, 5000).tolist() != order.tolist()
        assert GlobalPermutation(7, shuffle=False).take(0, 7).tolist() == list(range(7))

        sampler = ElasticSampler(100, shuffle=True, seed=1)
        sampler.set_epoch(0)
        step = [sampler.local_indices(0, 10, 3, rank).tolist() for rank in range(3)]
        assert sorted(sum(step, [])) == sorted(sampler.permutation.take(0, 10).tolist())
    """))


def test_token_planner_works_without_torch(no_torch_env):
    check(run_without_torch(no_torch_env, """
        import random
        from adaptive.data import GlobalPermutation
        from adaptive.data.tokens import OversizeSampleError, SampleLengths, TokenBudgetPlanner

        rng = random.Random(0)
        lengths = [rng.randint(1, 60) for _ in range(500)]
        assert SampleLengths(lengths).num_samples == 500
        planner = TokenBudgetPlanner(lengths, max_tokens=128, num_replicas=2, accumulation_steps=2, seed=0)
        seen = []
        for step in planner.plan_epoch(GlobalPermutation(500, seed=0), epoch=0):
            assert len(step.micro_batches) == 2
            for replica in step.micro_batches:
                for micro in replica:
                    assert micro.padded_tokens <= 128
                    if not micro.is_padding:
                        seen.extend(int(i) for i in micro.indices)
        assert sorted(seen) == list(range(500)), "every sample once per epoch"
        try:
            list(TokenBudgetPlanner([10, 500], max_tokens=128).plan_epoch(GlobalPermutation(2), epoch=0))
        except OversizeSampleError:
            pass
        else:
            raise AssertionError("a sample over the budget was accepted")
    """))


def test_rampup_schedules_work_without_torch(no_torch_env):
    check(run_without_torch(no_torch_env, """
        import adaptive
        import adaptive.batchsize.rampup
        from adaptive.batchsize import ConstantSchedule, LinearRampup, StagedSchedule

        assert StagedSchedule.__module__.startswith("adaptive.batchsize.")
        staged = StagedSchedule("0:64 200K:128")
        assert staged.batch_size_at(199_999) == 64 and staged.batch_size_at(200_000) == 128
        assert staged.final_batch_size == 128
        ramp = LinearRampup(start=64, increment=64, rampup=1_000_000, target=256)
        assert ramp.batch_size_at(0) == 64 and ramp.batch_size_at(10**7) == 256
        assert ConstantSchedule(32).batch_size_at(10**6) == 32
        assert adaptive.StagedSchedule is StagedSchedule  # the top-level names load without torch too
    """))


def test_adaptive_data_loader_says_it_needs_torch(no_torch_env):
    out = check(run_without_torch(no_torch_env, """
        import adaptive
        for get in (lambda: adaptive.AdaptiveDataLoader, lambda: __import__("adaptive.data").data.AdaptiveDataLoader):
            try:
                get()
            except ImportError as error:
                message = str(error)
                assert "torch" in message, message
                print("MESSAGE:", message)
            else:
                raise AssertionError("AdaptiveDataLoader loaded without torch")
    """))
    assert "MESSAGE:" in out


TINY_WORKLOAD = """name,time,application,num_replicas,batch_size
ncf-0,0,ncf,1,32768
cifar10-1,30,cifar10,2,2048
ncf-2,90,ncf,1,32768
"""


@pytest.mark.parametrize("policy", ["tiresias", "goodput"])
def test_simulator_command_runs_without_torch(no_torch_env, tmp_path, policy):
    workload = tmp_path / "tiny.csv"
    workload.write_text(TINY_WORKLOAD, encoding="utf-8")
    out = tmp_path / "out.json"
    result = run_without_torch(no_torch_env, "", str(workload), "--policy", policy, "--nodes", "1",
                               "--gpus-per-node", "4", "--json", str(out), module="scheduler.simulate",
                               timeout=300)
    check(result)
    summary = json.loads(out.read_text(encoding="utf-8"))
    assert summary["jobs"] == 3 and summary["policy"] == policy
    assert set(summary["jct"]) == {"ncf-0", "cifar10-1", "ncf-2"}
    assert all(jct > 0 for jct in summary["jct"].values())
    assert "Traceback" not in result.stderr
