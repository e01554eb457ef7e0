"""Generated workloads of the bundled kind, for checking a policy beyond five files.

A policy tuned on ``workload-1`` ... ``workload-5`` may only have learnt
those files. :func:`generate_workload` draws new workloads of the same
kind: jobs (model, tuned replicas, tuned batch) resampled with replacement
from the bundled workloads, submission times resampled from their pooled
(Philly-derived, diurnal) arrival times with jitter, then compressed or
stretched by ``rate`` (``rate=2`` submits the same number of jobs in half
the time). :data:`GENERATED_SET` names the cases the benchmark and the
comparison use: seeds, arrival rates 0.5-2x and cluster sizes 8-32 nodes
(the job count scales with the cluster so the load per GPU stays that of
the bundled workloads at ``rate=1``).

Command line (writes one workload CSV)::

    python -m scheduler.sim.generate OUT.csv [--seed 0] [--rate 1.0] [--jobs 160]
"""

from __future__ import annotations

import argparse
import csv
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from scheduler.profiles import DEFAULT_WORKLOADS_DIR
from scheduler.sim.workload import COLUMNS, WorkloadJob, load_workload

logger = logging.getLogger(__name__)

#: Bundled workloads the generator resamples.
SOURCE_WORKLOADS = tuple(f"workload-{i}" for i in range(1, 6))

#: Seconds of jitter added to each resampled submission time.
JITTER_S = 300.0


@dataclass(frozen=True)
class GeneratedCase:
    """One generated workload and the cluster it runs on."""

    seed: int
    rate: float
    nodes: int

    @property
    def name(self) -> str:
        return f"gen-s{self.seed}-r{self.rate:g}-n{self.nodes}"

    @property
    def num_jobs(self) -> int:
        return max(1, round(160 * self.nodes / 16))

    def jobs(self, gpus_per_node: int = 4) -> list[WorkloadJob]:
        """The case's workload, tuned sizes capped at its cluster's GPUs."""
        return generate_workload(self.seed, self.rate, self.num_jobs, max_replicas=self.nodes * gpus_per_node)


#: Arrival rates 0.5-2x and 8-32 nodes, each on fresh resampled jobs.
GENERATED_SET: tuple[GeneratedCase, ...] = (
    GeneratedCase(seed=101, rate=1.0, nodes=16),
    GeneratedCase(seed=102, rate=0.5, nodes=16),
    GeneratedCase(seed=103, rate=2.0, nodes=16),
    GeneratedCase(seed=104, rate=1.0, nodes=8),
    GeneratedCase(seed=105, rate=1.0, nodes=32),
    GeneratedCase(seed=106, rate=1.5, nodes=16),
)


def source_jobs(workloads_dir: str = DEFAULT_WORKLOADS_DIR,
                names: Sequence[str] = SOURCE_WORKLOADS) -> list[WorkloadJob]:
    """Every job of the bundled workloads, in file order."""
    jobs: list[WorkloadJob] = []
    for name in names:
        jobs.extend(load_workload(os.path.join(workloads_dir, name + ".csv")))
    return jobs


def generate_workload(seed: int, rate: float = 1.0, num_jobs: int = 160,
                      pool: Sequence[WorkloadJob] | None = None,
                      max_replicas: int | None = None) -> list[WorkloadJob]:
    """A workload of ``num_jobs`` jobs resampled from ``pool`` (default: the
    bundled workloads), arriving ``rate`` times as fast; deterministic for a seed.

    ``max_replicas`` caps each job's tuned replica count (a fixed-size
    policy cannot run a job larger than its cluster); the tuned batch size
    is kept."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if num_jobs < 1:
        raise ValueError(f"num_jobs must be >= 1, got {num_jobs}")
    pool = list(pool) if pool is not None else source_jobs()
    if not pool:
        raise ValueError("no jobs to resample from")
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(pool), size=num_jobs)
    times = np.array([j.submission_time for j in pool])[rng.integers(0, len(pool), size=num_jobs)]
    times = np.clip(times + rng.uniform(-JITTER_S, JITTER_S, size=num_jobs), 0.0, None) / rate
    order = np.argsort(times, kind="stable")
    jobs = []
    for i, k in enumerate(order):
        src = pool[int(picks[k])]
        jobs.append(WorkloadJob(name=f"{src.application}-{i}", submission_time=float(round(times[k])),
                                application=src.application,
                                num_replicas=min(src.num_replicas, max_replicas or src.num_replicas),
                                batch_size=src.batch_size))
    logger.debug("generated %d jobs (seed %d, rate %g)", num_jobs, seed, rate)
    return jobs


def write_workload(path: str, jobs: Sequence[WorkloadJob]) -> None:
    """Write ``jobs`` as a workload CSV that :func:`load_workload` reads back."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(COLUMNS)
        for j in jobs:
            writer.writerow([j.name, f"{j.submission_time:g}", j.application, j.num_replicas, j.batch_size])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scheduler.sim.generate",
                                     description="write a generated workload CSV")
    parser.add_argument("out", help="CSV to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rate", type=float, default=1.0, help="arrival-rate multiplier")
    parser.add_argument("--jobs", type=int, default=160, help="number of jobs")
    args = parser.parse_args(argv)
    try:
        write_workload(args.out, generate_workload(args.seed, args.rate, args.jobs))
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
