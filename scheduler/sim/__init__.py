"""The trace simulator: replays a workload of jobs through a policy on a simulated cluster.

:mod:`.workload` reads workloads, :mod:`.job` simulates one job from its
measured profile and :mod:`.simulator` runs the cluster; the command is
``python -m scheduler.simulate`` (:mod:`scheduler.simulate`).
"""
