"""Supervisor: the HTTP service where jobs report hints and read their allocation."""

from scheduler.supervisor.client import SupervisorClient, SupervisorError
from scheduler.supervisor.server import MAX_BODY_BYTES, SupervisorServer
from scheduler.supervisor.state import JobRecord, SupervisorState

__all__ = ["MAX_BODY_BYTES", "JobRecord", "SupervisorClient", "SupervisorError", "SupervisorServer",
           "SupervisorState"]
