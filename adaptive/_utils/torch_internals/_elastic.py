"""torchrun's elastic agent: end it, instead of restarting the workers, when a worker exits with a given status.

What ``adaptive-run`` (:mod:`adaptive.elastic.launcher`) needs from
torchrun's agent.  Part of the adapter :mod:`adaptive._utils.torch_internals`
(import the names from there).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup

__all__ = ["end_elastic_agent_on_exit_code", "ELASTIC_AGENT_OVERRIDDEN_METHODS"]


def end_elastic_agent_on_exit_code(code: int, make_error: Callable[[list[int]], BaseException],
                                   before_raise: Callable[[], None]) -> None:
    """Have torchrun's agent, in this process, end at the first worker that exits with ``code``.

    What: installs a subclass of ``LocalElasticAgent`` whose
    ``_monitor_workers`` (the hook by which ``SimpleElasticAgent``'s run loop
    polls the workers, left to its subclasses) returns torchrun's own result,
    except that at the first result of a failed worker group with a worker
    that exited with ``code`` it calls ``before_raise()`` (to kill the
    workers left), then raises ``make_error(ranks)`` (the global ranks that
    exited with ``code``, sorted).  The error ends the agent's run (the agent
    shuts its workers and rendezvous down) and propagates out of
    ``torch.distributed.run.run``.  Installed by setting
    ``torch.distributed.launcher.api.LocalElasticAgent``, the module global
    through which torchrun's ``launch_agent`` builds its agent; it applies to
    every later launch in this process.

    Why: torchrun's agent restarts the whole worker group on any failure
    while ``--max-restarts`` allows, and a usage or configuration error (a
    bad argument, a script that cannot be opened) fails the same way at every
    restart; torch has no public option to treat some exit statuses as final.

    Private pieces it depends on: the overridden method ``_monitor_workers``
    (:data:`ELASTIC_AGENT_OVERRIDDEN_METHODS`: were it renamed, the override
    would silently never run) and the module attribute
    ``torch.distributed.launcher.api.LocalElasticAgent`` being what
    ``launch_agent`` instantiates (a public-looking name, but replacing it is
    relying on torch's internals).  In torch since 1.9 (torchelastic's
    merge); checked on 2.13.
    """
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.launcher import api

    class EndsAtExitCode(LocalElasticAgent):
        """torchrun's local agent, except that a worker's exit with ``code`` ends it."""

        def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
            result: RunResult = super()._monitor_workers(worker_group)
            if result.state is WorkerState.FAILED:
                ranks = sorted(rank for rank, failure in result.failures.items() if failure.exitcode == code)
                if ranks:
                    before_raise()
                    raise make_error(ranks)
            return result

    api.LocalElasticAgent = EndsAtExitCode  # type: ignore[misc]


#: ``LocalElasticAgent`` methods with private names that :func:`end_elastic_agent_on_exit_code`'s agent
#: overrides; torch's run loop calls them itself, so a rename in torch would silently skip the override: the
#: tests check that the agent still has them.
ELASTIC_AGENT_OVERRIDDEN_METHODS: tuple[str, ...] = ("_monitor_workers",)
