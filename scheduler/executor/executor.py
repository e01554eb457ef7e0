"""The executor: runs real jobs where the policy says, through a backend.

Each step it

1. notices incarnations that ended: exit 0 means the job is done; an exit
   after it was asked to stop means it is ready to be relaunched; an exit
   caused by a lost node (:data:`LOST_NODE_EXIT`, or a kill because a node
   it used was lost), or by a live job's lost store (its launchers exit
   with :data:`STORE_LOST_EXIT`, the same 75), is an *infrastructure
   failure*, counted apart (``infra_failures``) and relaunched at once, up
   to the job's ``max_relaunches`` times; an exit with
   :data:`CONFIG_ERROR_EXIT` (2: a usage or configuration error, which a
   relaunch cannot fix) fails the job at once; any other exit is a crash,
   retried (with back-off) up to the job's ``max_failures``, and the last
   lines of its output become the job's ``last_error`` (logged with the
   first crash, with a new output, and when the executor gives up);
2. reads each job's ``hints.json`` into the supervisor state;
3. runs a scheduling round every ``interval`` seconds, or at once when a job
   arrived, finished or failed;
4. applies the decision: a running job whose allocation changed is stopped
   gracefully (SIGTERM: it checkpoints and exits; killed after
   ``grace_period``), and relaunched with its new replica count once its
   devices are free. Jobs resume exactly through their checkpoint folder.

Where the backend reports which nodes are alive (``Backend.alive_nodes``),
each step first compares them with the nodes in use: incarnations touching a
lost node are killed (an infrastructure failure: they are relaunched, not
charged), and the policy sees a cluster of the alive nodes only; its node
indices ``0..n-1`` are mapped onto the alive nodes' indices. The comparison
is made again right after an incarnation ended with a lost node, so that the
relaunch never goes back to the node that was just lost.

A step must never block: the backends answer every call at once (the Ray
backend launches asynchronously). A step longer than :data:`SLOW_STEP`
seconds is logged.

The executor never looks inside the policy, and reaches processes only
through :class:`~scheduler.executor.backend.Backend`.
"""

from __future__ import annotations

import enum
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from adaptive.goodput import read_json
from scheduler.allocator import Allocator
from scheduler.cluster import Allocation, ClusterSpec, make_allocation
from scheduler.executor.backend import CONFIG_ERROR_EXIT, LOST_NODE_EXIT, STORE_LOST_EXIT, Assignment, Backend
from scheduler.executor.jobspec import JobSpec
from scheduler.policies.base import Policy
from scheduler.supervisor.state import SupervisorState

logger = logging.getLogger(__name__)

#: Longest wait before relaunching a crashed job (doubles per failure from 1 s).
MAX_BACKOFF = 60.0
#: Seconds above which one step is logged as slow (something blocked the loop).
SLOW_STEP = 1.0
#: Lines of a crashed incarnation's output kept as the job's ``last_error``.
ERROR_LINES = 20


class JobState(str, enum.Enum):
    PENDING = "pending"      # waiting for an allocation (or for its devices to free up)
    RUNNING = "running"
    STOPPING = "stopping"    # asked to stop gracefully, not exited yet
    SUCCEEDED = "succeeded"
    FAILED = "failed"


@dataclass
class ManagedJob:
    """The executor's record of one job."""

    spec: JobSpec
    submitted_at: float
    state: JobState = JobState.PENDING
    handle: Any = None
    assignment: Assignment | None = None
    target: Allocation = ()
    launches: int = 0
    failures: int = 0
    infra_failures: int = 0
    last_exit: int | None = None
    last_error: str | None = None
    #: The running incarnation was killed because a node it used was lost.
    node_lost: bool = False
    stop_deadline: float = 0.0
    not_before: float = 0.0
    finished_at: float | None = None
    hints_mtime: float = 0.0
    progress: float | None = None

    @property
    def finished(self) -> bool:
        return self.state in (JobState.SUCCEEDED, JobState.FAILED)

    def status(self) -> dict[str, Any]:
        return {"name": self.spec.name, "state": self.state.value,
                "replicas": self.assignment.num_replicas if self.assignment else 0,
                "target_replicas": len(self.target), "launches": self.launches,
                "restarts": max(self.launches - 1, 0), "failures": self.failures,
                "infra_failures": self.infra_failures, "last_exit": self.last_exit,
                "last_error": self.last_error, "progress": self.progress,
                "placement": list(self.assignment.nodes) if self.assignment else [],
                "submitted_at": self.submitted_at, "finished_at": self.finished_at,
                "min_replicas": self.spec.min_replicas, "max_replicas": self.spec.max_replicas}


class Executor:
    """Runs submitted jobs on ``cluster`` under ``policy`` through ``backend``.

    Args:
        backend: starts and stops incarnations.
        policy: decides allocations.
        cluster: the devices (one node with N slots for the local backend).
        state: supervisor state (hints, allocations); in memory by default.
        interval: seconds between scheduling rounds without events.
        grace_period: seconds a job may take to stop before it is killed.
        clock: time source in seconds.
    """

    def __init__(self, backend: Backend, policy: Policy, cluster: ClusterSpec,
                 state: SupervisorState | None = None, interval: float = 60.0,
                 grace_period: float = 120.0, clock: Callable[[], float] = time.time):
        if interval <= 0 or grace_period <= 0:
            raise ValueError(f"interval and grace_period must be > 0 s, got {interval}, {grace_period}")
        self.backend = backend
        self.cluster = cluster
        self.state = state if state is not None else SupervisorState()
        self.allocator = Allocator(policy, cluster, self.state)
        self.interval = float(interval)
        self.grace_period = float(grace_period)
        self.clock = clock
        self.jobs: dict[str, ManagedJob] = {}
        self._next_round = 0.0
        self._dirty = False
        #: The backend's node index of each of the policy's nodes ``0..n-1``.
        self._nodes: tuple[int, ...] = tuple(range(cluster.num_nodes))

    # --------------------------------------------------------------- public
    def submit(self, spec: JobSpec) -> None:
        """Add a job; it starts when the policy gives it devices."""
        if spec.name in self.jobs:
            raise ValueError(f"a job named {spec.name!r} was already submitted")
        now = self.clock()
        self.jobs[spec.name] = ManagedJob(spec, submitted_at=now)
        self.state.register_job(spec.name, {"min_replicas": spec.min_replicas,
                                            "max_replicas": spec.max_replicas,
                                            "preemptible": spec.preemptible, "submission_time": now})
        self._dirty = True
        logger.info("submitted %s (replicas %d..%d)", spec.name, spec.min_replicas, spec.max_replicas)

    def step(self) -> None:
        """One pass: follow the nodes, reap exits, read hints, maybe reschedule, apply."""
        started = time.monotonic()
        now = self.clock()
        self._sync_nodes(now)
        if self._reap(now):
            self._sync_nodes(now)  # the backend saw a node fail: leave it out before relaunching
        self._read_hints()
        if self._dirty or now >= self._next_round:
            self._schedule(now)
        self._apply(now)
        took = time.monotonic() - started
        if took > SLOW_STEP:
            logger.warning("an executor step took %.1f s (a backend call blocked?)", took)

    @property
    def done(self) -> bool:
        """All submitted jobs have succeeded or failed."""
        return all(job.finished for job in self.jobs.values())

    def status(self) -> list[dict[str, Any]]:
        """One dict per job, in submission order."""
        return [job.status() for job in self.jobs.values()]

    def shutdown(self, timeout: float = 60.0, poll: float = 0.2) -> None:
        """Stop every running job gracefully (kill after ``timeout``) and wait."""
        deadline = self.clock() + timeout
        for job in self.jobs.values():
            if job.state in (JobState.RUNNING, JobState.STOPPING):
                self.backend.stop(job.handle)
        while any(j.state in (JobState.RUNNING, JobState.STOPPING) for j in self.jobs.values()):
            for job in self.jobs.values():
                if job.state in (JobState.RUNNING, JobState.STOPPING):
                    code = self.backend.poll(job.handle)
                    if code is not None:
                        job.state, job.last_exit, job.handle, job.assignment = JobState.PENDING, code, None, None
                    elif self.clock() > deadline:
                        self.backend.kill(job.handle)
            time.sleep(poll)
        self.backend.close()

    # ------------------------------------------------------------- internals
    def _sync_nodes(self, now: float) -> None:
        """Follow the backend's alive nodes: kill jobs on lost ones, re-map the policy's cluster."""
        reported = self.backend.alive_nodes()
        if reported is None:
            return
        alive = tuple(sorted(set(int(n) for n in reported)))
        if alive == self._nodes:
            return
        lost = set(self._nodes) - set(alive)
        if lost:
            logger.warning("lost node(s) %s; %d node(s) left", sorted(lost), len(alive))
        for job in self.jobs.values():
            if (job.state in (JobState.RUNNING, JobState.STOPPING) and job.assignment is not None
                    and lost & set(job.assignment.nodes)):
                logger.warning("%s ran on lost node(s) %s; killing the incarnation", job.spec.name,
                               sorted(lost & set(job.assignment.nodes)))
                job.node_lost = True
                self.backend.kill(job.handle)
        index = {node: i for i, node in enumerate(alive)}
        remapped = {}
        for name, alloc in self.state.allocations().items():
            real = [self._nodes[i] for i in alloc]
            if all(node in index for node in real):
                remapped[name] = make_allocation(index[node] for node in real)
        self.state.set_allocations(remapped, now)
        self._nodes = alive
        if alive:
            self.allocator.cluster = ClusterSpec(len(alive), self.cluster.gpus_per_node)
        self._dirty = True

    def _reap(self, now: float) -> bool:
        """Handle the incarnations that ended; whether one of them ended with a lost node."""
        any_lost = False
        for job in self.jobs.values():
            if job.state not in (JobState.RUNNING, JobState.STOPPING):
                continue
            code = self.backend.poll(job.handle)
            if code is None:
                if job.state is JobState.STOPPING and now >= job.stop_deadline:
                    logger.warning("%s did not stop within %.0f s; killing it", job.spec.name, self.grace_period)
                    self.backend.kill(job.handle)
                continue
            stopping, handle = job.state is JobState.STOPPING, job.handle
            lost = job.node_lost or code in (LOST_NODE_EXIT, STORE_LOST_EXIT)
            job.last_exit, job.handle, job.assignment, job.node_lost = code, None, None, False
            if code == 0:
                self._finish(job, JobState.SUCCEEDED, now)
            elif code == CONFIG_ERROR_EXIT and not stopping:
                self._config_error(job, code, handle, now)
            elif lost:
                any_lost = True
                self._infra_failure(job, code, now)
            elif stopping:
                job.state = JobState.PENDING
                logger.info("%s stopped (exit %d) for reallocation", job.spec.name, code)
            else:
                self._crash(job, code, handle, now)
        return any_lost

    def _infra_failure(self, job: ManagedJob, code: int, now: float) -> None:
        """A lost node (or a live job's lost store) ended the incarnation: not the job's fault, so relaunch at
        once, uncharged to ``max_failures``; after ``max_relaunches`` of them the job fails (a loss that comes
        back at every launch must end)."""
        job.infra_failures += 1
        if job.infra_failures > job.spec.max_relaunches:
            logger.error("%s lost a node or its store (exit %d) %d times, more than its max_relaunches (%d): "
                         "giving up", job.spec.name, code, job.infra_failures, job.spec.max_relaunches)
            self._finish(job, JobState.FAILED, now)
            return
        job.state, job.not_before = JobState.PENDING, now
        self._dirty = True
        logger.warning("%s lost a node or its store (exit %d): infrastructure failure %d of %d relaunches "
                       "allowed, not counted against max_failures; relaunching on the nodes left", job.spec.name,
                       code, job.infra_failures, job.spec.max_relaunches)

    def _config_error(self, job: ManagedJob, code: int, handle: Any, now: float) -> None:
        """The job ended on a usage or configuration error (exit 2): a relaunch would end the same way, so the
        job fails now, with the end of its output as its ``last_error``."""
        job.failures += 1
        job.last_error = self._log_tail(handle)
        shown = f"; last lines of its output:\n{_indent(job.last_error)}" if job.last_error else ""
        logger.error("%s exited with %d, a usage or configuration error that a relaunch cannot fix; not "
                     "relaunching it%s", job.spec.name, code, shown)
        self._finish(job, JobState.FAILED, now)

    def _crash(self, job: ManagedJob, code: int, handle: Any, now: float) -> None:
        """The job's own failure: keep its output's tail, retry with back-off or give up."""
        job.failures += 1
        tail = self._log_tail(handle)
        new_output = tail is not None and tail != job.last_error
        job.last_error = tail
        shown = f"; last lines of its output:\n{_indent(tail)}" if tail else ""
        if job.failures > job.spec.max_failures:
            logger.error("%s failed %d times (last exit %d); giving up%s", job.spec.name, job.failures, code, shown)
            self._finish(job, JobState.FAILED, now)
            return
        delay = min(2.0 ** (job.failures - 1), MAX_BACKOFF)
        job.state, job.not_before = JobState.PENDING, now + delay
        logger.warning("%s crashed (exit %d, failure %d of %d allowed); relaunching in %.0f s%s", job.spec.name,
                       code, job.failures, job.spec.max_failures, delay,
                       shown if new_output else " (same output as the previous failure)" if tail else "")

    def _log_tail(self, handle: Any) -> str | None:
        """The last lines of the incarnation's output, if the backend can read them."""
        try:
            text = self.backend.log_tail(handle, lines=ERROR_LINES)
        except OSError as exc:
            logger.debug("could not read the output of %s: %s", handle, exc)
            return None
        return (text.strip() or None) if isinstance(text, str) else None

    def _finish(self, job: ManagedJob, state: JobState, now: float) -> None:
        job.state, job.finished_at, job.target = state, now, ()
        self.state.remove_job(job.spec.name)
        self._dirty = True
        logger.info("%s %s after %.0f s", job.spec.name, state.value, now - job.submitted_at)

    def _read_hints(self) -> None:
        for job in self.jobs.values():
            if job.finished:
                continue
            found = [(os.stat(p).st_mtime, p) for p in job.spec.hints_paths if os.path.exists(p)]
            if not found:
                continue
            mtime, path = max(found)
            if mtime <= job.hints_mtime:
                continue
            job.hints_mtime = mtime
            try:
                hints = read_json(path)
                self.state.update_hints(job.spec.name, hints)
                # no "progress" key: float(None) raises the TypeError caught below
                job.progress = (float(hints.get("progress"))  # type: ignore[arg-type]
                                if isinstance(hints, dict) else None)
            except (OSError, ValueError, TypeError) as exc:
                logger.warning("%s: ignoring hints in %s: %s", job.spec.name, path, exc)

    def _schedule(self, now: float) -> None:
        decided = self.allocator.step(now) if self._nodes else {}
        for name, job in self.jobs.items():
            if not job.finished:
                job.target = tuple(self._nodes[i] for i in decided.get(name, ()))
        self._dirty = False
        self._next_round = now + self.interval

    def _apply(self, now: float) -> None:
        for job in self.jobs.values():
            current = job.assignment
            if job.state is JobState.RUNNING and current is not None and sorted(current.nodes) != sorted(job.target):
                if self._resize_live(job):
                    continue
                logger.info("%s: stopping to move from %d to %d replicas", job.spec.name,
                            current.num_replicas, len(job.target))
                self.backend.stop(job.handle)
                job.state, job.stop_deadline = JobState.STOPPING, now + self.grace_period
        free = self._free_devices()
        for job in self.jobs.values():
            if job.state is not JobState.PENDING or not job.target or now < job.not_before:
                continue
            assignment = self._assign(job.target, free)
            if assignment is None:
                continue  # devices still held by jobs that are stopping
            job.assignment = assignment
            job.launches += 1
            job.handle = self.backend.launch(job.spec, assignment, job.launches)
            job.state = JobState.RUNNING

    def _resize_live(self, job: ManagedJob) -> bool:
        """Resize a running job in place when the backend can (live mode); whether it did.

        The replicas that stay keep their devices; new ones take free
        devices (when none are free yet, the job waits for them, running).
        """
        current = job.assignment
        if not job.target or current is None:
            return False
        kept = Executor._kept_devices(current, job.target)
        free = self._free_devices()
        extra = [node for node in job.target]
        for node, _ in kept:
            extra.remove(node)
        grown = Executor._assign(tuple(extra), free) if extra else None
        if extra and grown is None:
            return True  # devices still held by jobs that are shrinking or stopping: try again next step
        pairs = kept + ([] if grown is None else list(zip(grown.nodes, grown.devices)))
        assignment = Assignment(tuple(n for n, _ in pairs), tuple(d for _, d in pairs))
        if not self.backend.resize(job.handle, assignment):
            return False
        logger.info("%s: resized live from %d to %d replicas", job.spec.name, current.num_replicas,
                    assignment.num_replicas)
        job.assignment = assignment
        return True

    @staticmethod
    def _kept_devices(current: Assignment, target: Allocation) -> list[tuple[int, int]]:
        """The (node, device) pairs of ``current`` that ``target`` keeps, in ``current``'s order."""
        need: dict[int, int] = {}
        for node in target:
            need[node] = need.get(node, 0) + 1
        kept = []
        for node, device in zip(current.nodes, current.devices):
            if need.get(node, 0) > 0:
                need[node] -= 1
                kept.append((node, device))
        return kept

    def _free_devices(self) -> dict[int, list[int]]:
        used = {(n, d) for j in self.jobs.values() if j.assignment is not None
                for n, d in zip(j.assignment.nodes, j.assignment.devices)}
        return {n: [d for d in range(self.cluster.gpus_per_node) if (n, d) not in used]
                for n in self._nodes}

    @staticmethod
    def _assign(target: Allocation, free: dict[int, list[int]]) -> Assignment | None:
        """Devices for ``target`` (node per replica) from ``free``, taken out of it; ``None`` if busy."""
        need: dict[int, int] = {}
        for node in target:
            need[node] = need.get(node, 0) + 1
        if any(len(free.get(n, ())) < k for n, k in need.items()):
            return None
        devices: list[tuple[int, int]] = []
        for node, count in sorted(need.items()):
            devices.extend((node, d) for d in free[node][:count])
            del free[node][:count]
        return Assignment(tuple(n for n, _ in devices), tuple(d for _, d in devices))


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.splitlines())
