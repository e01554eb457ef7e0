"""What a Ray incarnation holds on the cluster: reserving its nodes' slots and giving them back.

Internal to :class:`~scheduler.executor.ray_backend.RayBackend`, which
decides *when*; this module knows *how*, without ever waiting on Ray:

* **Reserving** (:func:`reserve`, :func:`launcher_actor`): one placement group
  per incarnation with one bundle per node, pinned to that node by its
  ``ray.io/node-id`` label and holding that node's slots, and in each bundle
  one :class:`~scheduler.executor.ray_node.NodeLauncher` actor that takes the
  bundle whole (so that, with GPUs, Ray hands it the device ids).
* **Giving back** (:class:`Releases`): an ended incarnation's actors are first
  told to SIGKILL their process groups; only once they confirmed it (or after
  :data:`RELEASE_GRACE` s) are the actors killed and the placement group
  removed, so the slots go to another incarnation only after what ran on them
  was ended. Each :meth:`Releases.finish` checks the confirmations with
  ``ray.wait(timeout=0)``.

The lines it logs are the backend's, under the backend's logger.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from scheduler.executor._ray_handle import RayHandle
from scheduler.executor.ray_import import import_ray
from scheduler.executor.ray_pool import RayPool

ray = import_ray()
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group  # noqa: E402
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: E402

from scheduler.executor.ray_node import NodeLauncher  # noqa: E402

__all__ = ["NODE_ID_LABEL", "RELEASE_GRACE", "Releases", "launcher_actor", "reserve"]

logger = logging.getLogger("scheduler.executor.ray_backend")  # the backend's own lines, under its logger

#: Ray's label with a node's id, which pins a bundle to that node.
NODE_ID_LABEL = "ray.io/node-id"
#: Seconds an ended incarnation's actors get to confirm the SIGKILL before they and the placement group go.
RELEASE_GRACE = 2.0

_RemoteLauncher = ray.remote(NodeLauncher)


def reserve(pool: RayPool, nodes: Sequence[int], slots: Sequence[int], name: str) -> PlacementGroup:
    """Ask for the placement group of ``slots[i]`` slots on each pool node ``nodes[i]`` (returns at once).

    Raises ``KeyError`` for a node the pool does not know, and what Ray raises for a request it refuses.
    """
    selectors = [{NODE_ID_LABEL: pool.node(n).node_id} for n in nodes]
    return placement_group([{pool.resource: float(k)} for k in slots], strategy="PACK", name=name,
                           bundle_label_selector=selectors)


def launcher_actor(group: PlacementGroup, index: int, slots: int, resource: str) -> Any:
    """Create the launcher actor of bundle ``index`` of ``group``, taking its ``slots`` of ``resource``."""
    options: dict[str, Any] = {"num_cpus": 0, "num_gpus": 0, "resources": {}, "max_restarts": 0,
                               "max_concurrency": 4,
                               "scheduling_strategy": PlacementGroupSchedulingStrategy(
                                   group, placement_group_bundle_index=index)}
    options.update(_actor_resources(resource, slots))
    return _RemoteLauncher.options(**options).remote()


def _actor_resources(resource: str, slots: int) -> dict[str, Any]:
    """Actor options that take the node's whole bundle (``num_cpus``/``num_gpus`` for those resources)."""
    if resource == "CPU":
        return {"num_cpus": slots}
    if resource == "GPU":
        return {"num_gpus": slots}
    return {"resources": {resource: float(slots)}}


@dataclass
class _Release:
    """What an ended incarnation still holds, freed once its SIGKILLs were confirmed or at ``deadline``."""

    name: str
    actors: list[Any]
    placement_group: PlacementGroup | None
    signals: list[Any]
    deadline: float


class Releases:
    """The ended incarnations whose actors and placement groups are still to be freed."""

    def __init__(self) -> None:
        self._pending: list[_Release] = []

    def __len__(self) -> int:
        return len(self._pending)

    def release(self, handle: RayHandle, now: float) -> None:
        """SIGKILL what may still run of ``handle``, which then holds nothing; its actors and placement
        group go once that is confirmed (:meth:`finish`)."""
        signals = [actor.signal.remote(int(signal.SIGKILL)) for actor in handle.actors]
        self._pending.append(_Release(handle.name, handle.actors, handle.placement_group, signals,
                                      now + RELEASE_GRACE))
        handle.actors, handle.placement_group = [], None

    def finish(self, now: float, force: bool = False) -> None:
        """Free the releases whose SIGKILLs were confirmed or whose grace ran out (all, with ``force``)."""
        keep = []
        for release in self._pending:
            refs = release.signals
            confirmed = not refs or len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) == len(refs)
            if confirmed or force or now >= release.deadline:
                self._free(release)
            else:
                keep.append(release)
        self._pending = keep

    @staticmethod
    def _free(release: _Release) -> None:
        for actor in release.actors:
            try:
                ray.kill(actor, no_restart=True)
            except ray.exceptions.RayError as exc:
                logger.debug("%s: actor already gone: %s", release.name, exc)
        if release.placement_group is not None:
            try:
                remove_placement_group(release.placement_group)
            except ray.exceptions.RayError as exc:
                logger.debug("%s: placement group already gone: %s", release.name, exc)
