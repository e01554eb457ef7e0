"""Live mode: a node asked to be drained leaves the job before a planned stop, without a signal.

A scheduler or an operator who knows that a machine goes away soon (a
maintenance window, a spot instance's notice, a smaller allocation) asks the
job, through its store, to let that node's members go:
``adaptive drain --endpoint HOST:PORT --job-id JOB --node N`` or
:func:`request_drain`.  No process of that machine needs to be reached or
signalled.

The members learn of it at an agreement boundary, as of a join: rank 0
reads how many drain requests wait (:func:`pending_drains`) into the
per-step agreement (:class:`adaptive.elastic.step_flags.StepFlags`), and at
the boundary where that was agreed every member of a drained node leaves,
with nothing lost, while the others go on
(:func:`adaptive.elastic.live.change`).  The node's launcher then ends with
143, as after a stop, without starting its workers again.

With a secret the requests are signed records (``adaptive drain`` signs
with the same ``ADAPTIVE_LIVE_SECRET``): a forged one drains nothing.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from adaptive.runtime.live_protocol import DRAINS_PENDING_KEY, drain_key

if TYPE_CHECKING:
    import torch.distributed

__all__ = ["request_drain", "pending_drains", "is_drained", "mark_served"]

logger = logging.getLogger(__name__)


def request_drain(store: torch.distributed.Store, node: int) -> None:
    """Ask the members of node ``node`` to leave at the job's next agreement (``store``: the job's keys)."""
    if isinstance(node, bool) or not isinstance(node, int) or node < 1:
        raise ValueError(f"node must be a launcher's node number >= 1, got {node!r}")
    asked = repr(time.time())
    if store.compare_set(drain_key(node), "", asked).decode() != asked:  # one request per node, however often asked
        logger.info("node %d was already asked to drain", node)
        return
    store.add(DRAINS_PENDING_KEY, 1)


def pending_drains(store: torch.distributed.Store) -> int:
    """How many drain requests the members have not served yet (one store read, on rank 0 at each agreement).

    On a signed store the count is a hint only (anyone can add to it): when
    it is not 0, the drain requests of this generation's nodes are read, and
    those that pass authentication count.
    """
    from adaptive.runtime import signed_records
    from adaptive.runtime.membership import membership

    count = int(store.add(DRAINS_PENDING_KEY, 0))
    if count == 0 or not signed_records.is_signed(store):
        return count
    generation = membership().generation
    if generation is None:
        return 0
    return sum(1 for node in sorted({m.node for m in generation.members}) if is_drained(store, node))


def is_drained(store: torch.distributed.Store, node: int) -> bool:
    """Whether node ``node`` was asked to drain (its members leave, its launcher starts none again)."""
    return bool(store.check([drain_key(node)]))


def mark_served(store: torch.distributed.Store, count: int) -> None:
    """On rank 0, at the change that let the drained members go: ``count`` requests are served."""
    if count > 0:
        store.add(DRAINS_PENDING_KEY, -count)
