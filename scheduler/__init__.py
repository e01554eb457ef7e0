"""The cluster side: policy, simulator, supervisor and executor.

The names below are what a policy author or a simulation script needs::

    from scheduler import ClusterSpec, make_policy, run_simulation

    result = run_simulation("workload-1", "goodput")
    print(result.avg_jct, result.makespan)

The HTTP supervisor (:mod:`scheduler.supervisor`), the one-machine
executor (:mod:`scheduler.executor`) and the supervisor's allocation loop
(:mod:`scheduler.allocator`) are imported from their own modules, so that
importing ``scheduler`` starts no server machinery.
"""

from scheduler.cluster import Allocation, ClusterSpec, check_allocations
from scheduler.job_info import JobInfo, job_info_from_hints
from scheduler.policies import POLICIES, GoodputPolicy, Policy, TiresiasPolicy, make_policy
from scheduler.sim.simulator import SimulationResult, Simulator, run_simulation
from scheduler.speedup import SpeedupFunction

__all__ = [
    "POLICIES",
    "Allocation",
    "ClusterSpec",
    "GoodputPolicy",
    "JobInfo",
    "Policy",
    "SimulationResult",
    "Simulator",
    "SpeedupFunction",
    "TiresiasPolicy",
    "check_allocations",
    "job_info_from_hints",
    "make_policy",
    "run_simulation",
]
