"""Executor: runs real training jobs on local slots as the policy decides."""

from scheduler.executor.backend import Assignment, Backend
from scheduler.executor.executor import Executor, JobState, ManagedJob
from scheduler.executor.jobspec import JobSpec, load_job_spec
from scheduler.executor.local import LocalBackend
from scheduler.executor.spool import Spool

__all__ = ["Assignment", "Backend", "Executor", "JobSpec", "JobState", "LocalBackend", "ManagedJob", "Spool",
           "load_job_spec"]
