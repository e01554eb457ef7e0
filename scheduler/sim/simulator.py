"""Trace-driven cluster simulator: replays a workload under a policy.

Time advances in scheduling rounds of ``interval`` seconds. At the start
of each round (``t = 0, interval, 2 * interval, ...``) the policy sees the
jobs submitted so far and not finished, and returns allocations; jobs
whose allocation changed are restarted (``restart_penalty`` seconds without
progress); then every job runs for the round at the speed its measured
profile gives (:mod:`scheduler.sim.job`). A job's completion time (JCT) is
its finish time minus its submission time, so it includes the wait for the
next round. The makespan is the last finish time minus the first
submission time.

:func:`run_simulation` loads the traces and a workload CSV (a path or a
bundled ``workload-N``) and runs a :class:`Simulator`; it is what
``python -m scheduler.simulate`` calls.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from scheduler.cluster import Allocation, ClusterSpec, check_allocations
from scheduler.job_info import JobInfo, job_info_from_model
from scheduler.policies import POLICIES, make_policy
from scheduler.policies.base import Policy
from scheduler.profiles import DEFAULT_TRACES_DIR, DEFAULT_WORKLOADS_DIR, ModelProfile, load_profiles
from scheduler.sim.job import SimulatedJob, ThroughputModels
from scheduler.speedup import SpeedupCache
from scheduler.sim.workload import WorkloadJob, load_workload

logger = logging.getLogger(__name__)


@dataclass
class SimulationResult:
    """Outcome of one simulated workload."""

    policy: str
    jct: dict[str, float]
    makespan: float
    num_rounds: int
    wall_time: float
    decision_times: list[float] = field(repr=False, default_factory=list)
    restarts: dict[str, int] = field(repr=False, default_factory=dict)
    timeline: list[tuple[float, dict[str, int]]] = field(repr=False, default_factory=list)

    @property
    def jobs(self) -> int:
        return len(self.jct)

    @property
    def avg_jct(self) -> float:
        return float(np.mean(list(self.jct.values())))

    @property
    def p99_jct(self) -> float:
        return float(np.percentile(list(self.jct.values()), 99))

    def to_dict(self, include_timeline: bool = False) -> dict[str, Any]:
        """JSON-ready summary (``jct`` per job; timeline on request)."""
        times = np.array(self.decision_times or [0.0])
        out: dict[str, Any] = {
            "policy": self.policy,
            "jobs": self.jobs,
            "avg_jct": self.avg_jct,
            "p99_jct": self.p99_jct,
            "makespan": self.makespan,
            "num_rounds": self.num_rounds,
            "wall_time": self.wall_time,
            "decision_time_mean": float(times.mean()),
            "decision_time_max": float(times.max()),
            "total_restarts": int(sum(self.restarts.values())),
            "jct": dict(self.jct),
            "restarts": dict(self.restarts),
        }
        if include_timeline:
            out["timeline"] = [{"time": t, "replicas": r} for t, r in self.timeline]
        return out


class Simulator:
    """Replays ``workload`` on ``cluster`` under ``policy``.

    Args:
        workload: jobs to submit (any order).
        profiles: measured profile per application name.
        policy: the allocation policy.
        cluster: cluster shape (16 x 4 GPUs by default).
        interval: seconds per scheduling round.
        restart_penalty: seconds a job loses on each (re)allocation.
        max_time: give up (``RuntimeError``) if jobs are unfinished by then.
        record_timeline: keep replicas per job per round (for plots).
        throughput_models: cache of fitted throughput models to share between
            runs on the same traces (a fresh one by default).
    """

    def __init__(self, workload: Sequence[WorkloadJob], profiles: Mapping[str, ModelProfile],
                 policy: Policy, cluster: ClusterSpec | None = None, interval: float = 60.0,
                 restart_penalty: float = 30.0, max_time: float = 60 * 86400.0,
                 record_timeline: bool = False, throughput_models: ThroughputModels | None = None):
        if interval <= 0:
            raise ValueError(f"interval must be > 0 seconds, got {interval}")
        if restart_penalty < 0:
            raise ValueError(f"restart_penalty must be >= 0 seconds, got {restart_penalty}")
        unknown = sorted({j.application for j in workload} - set(profiles))
        if unknown:
            raise ValueError(f"no profile for application(s) {unknown}; known: {sorted(profiles)}")
        self.cluster = cluster or ClusterSpec()
        self.policy = policy
        self.interval = float(interval)
        self.max_time = float(max_time)
        self.record_timeline = record_timeline
        self._speedups = SpeedupCache()
        self.throughput_models = throughput_models if throughput_models is not None else ThroughputModels()
        self.jobs = [SimulatedJob(spec, profiles[spec.application], policy.adaptive, restart_penalty,
                                  self.throughput_models)
                     for spec in sorted(workload, key=lambda j: (j.submission_time, j.name))]
        too_big = [j.name for j in self.jobs if j.spec.num_replicas > self.cluster.total_gpus]
        if too_big and not policy.adaptive:
            raise ValueError(f"jobs need more GPUs than the cluster has ({self.cluster.total_gpus}): {too_big}")

    def run(self) -> SimulationResult:
        """Simulate until every job is done."""
        started = time.perf_counter()
        now, rounds = 0.0, 0
        allocations: dict[str, Allocation] = {}
        decision_times: list[float] = []
        timeline: list[tuple[float, dict[str, int]]] = []
        while not all(job.done for job in self.jobs):
            if now > self.max_time:
                left = [j.name for j in self.jobs if not j.done]
                raise RuntimeError(f"{len(left)} jobs unfinished after {self.max_time:.0f} s: {left[:10]}")
            active = {j.name: j for j in self.jobs if j.submission_time <= now and not j.done}
            self._speedups.retain(list(active))
            if active:
                infos = {name: self._job_info(job, now) for name, job in active.items()}
                current = {n: a for n, a in allocations.items() if n in active}
                tick = time.perf_counter()
                decided = self.policy.optimize(infos, self.cluster, current, now)
                decision_times.append(time.perf_counter() - tick)
                allocations = {n: tuple(a) for n, a in decided.items() if a}
                check_allocations(allocations, self.cluster, infos, current,
                                  exclusive_multinode=self.policy.avoids_interference)
                for name, job in active.items():
                    job.reallocate(allocations.get(name, ()))
                if self.record_timeline:
                    timeline.append((now, {n: len(a) for n, a in allocations.items()}))
            for job in active.values():
                job.advance(now, self.interval)
            now += self.interval
            rounds += 1
        wall = time.perf_counter() - started
        ends = [cast(float, j.completion_time) for j in self.jobs]  # every job is done here
        jct = {j.name: end - j.submission_time for j, end in zip(self.jobs, ends)}
        makespan = max(ends) - min(j.submission_time for j in self.jobs)
        result = SimulationResult(policy=self.policy.name, jct=jct, makespan=makespan,
                                  num_rounds=rounds, wall_time=wall, decision_times=decision_times,
                                  restarts={j.name: j.num_restarts for j in self.jobs},
                                  timeline=timeline)
        logger.info("%s: %d jobs, avg JCT %.0f s, makespan %.0f s, %d rounds in %.1f s",
                    result.policy, result.jobs, result.avg_jct, makespan, rounds, wall)
        return result

    def _job_info(self, job: SimulatedJob, now: float) -> JobInfo:
        """The policy's view of ``job``: its tuned size, or (adaptive) what its hints would say."""
        if not self.policy.adaptive:
            return JobInfo(name=job.name, submission_time=job.submission_time, min_replicas=0,
                           max_replicas=job.spec.num_replicas, attained_service=job.attained_service,
                           num_restarts=job.num_restarts)
        prof = job.profile
        return job_info_from_model(
            job.name, job.goodput_function(), submission_time=job.submission_time,
            max_batch_size=prof.max_batch_size, local_bsz_bounds=(prof.min_local_bsz, prof.max_local_bsz),
            gradient_accumulation=True, max_profiled_replicas=job.max_profiled_replicas,
            max_replicas=self.cluster.total_gpus, attained_service=job.attained_service,
            num_restarts=job.num_restarts, speedup_cache=self._speedups, progress=job.progress,
            completed_fraction=job.completed_fraction)


def resolve_workload(path: str) -> str:
    """``path`` itself if it exists, else the bundled workload of that name."""
    if os.path.exists(path):
        return path
    name = os.path.basename(path)
    bundled = os.path.join(DEFAULT_WORKLOADS_DIR, name if name.endswith(".csv") else name + ".csv")
    if os.path.exists(bundled):
        return bundled
    available = sorted(f[:-4] for f in os.listdir(DEFAULT_WORKLOADS_DIR) if f.endswith(".csv"))
    raise FileNotFoundError(f"workload not found: {path} (bundled: {available})")


def run_simulation(workload: str, policy: str, traces: str = DEFAULT_TRACES_DIR,
                   interval: float = 60.0, restart_penalty: float = 30.0,
                   cluster: ClusterSpec | None = None, seed: int = 0,
                   record_timeline: bool = False) -> SimulationResult:
    """Load inputs, simulate, return the result (the CLI without printing).

    ``seed`` seeds Python's and NumPy's global generators before the run so
    that any randomised policy is reproducible; the simulator and the
    built-in policies are deterministic.
    """
    random.seed(seed)
    np.random.seed(seed)
    profiles = load_profiles(traces)
    jobs = load_workload(resolve_workload(workload), applications=profiles)
    options = {"restart_penalty": restart_penalty} if POLICIES[policy].adaptive else {}
    sim = Simulator(jobs, profiles, make_policy(policy, **options), cluster=cluster,
                    interval=interval, restart_penalty=restart_penalty,
                    record_timeline=record_timeline)
    return sim.run()
