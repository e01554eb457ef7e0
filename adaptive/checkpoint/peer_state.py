"""The training state handed from the running members to joiners, over the process group (live mode).

When a live generation admits new members (see
:mod:`adaptive.runtime.membership`), the joiners do not read the checkpoint
on disk: the new rank 0, a member that kept running, serialises every
registered state exactly as a checkpoint would hold it (after each state's
``sync()``, which the old generation ran) and sends it to each joiner on
the control group (the other members take no part); each joiner keeps it as a :class:`PeerCheckpoint`, which the
states it built restore from at its admission, and those it builds later as
they are created, the way they restore from a checkpoint after a restart
(:mod:`adaptive.checkpoint.admission`, :func:`adaptive.checkpoint.states.load_state`).  The bytes
are loaded weights-only, like a file (guarantee G4), but in a flat format
that spares the zip archive's copies and checksums
(:mod:`adaptive.checkpoint._flat_state`).

A sharded state (FSDP2) sends only its small part this way; its shards are
then read through :meth:`PeerCheckpoint.read_sharded`, which rank 0 fills
from its full copy (:mod:`adaptive.checkpoint.peer_shards`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist

from adaptive._utils.types import JSON, StateDict
from adaptive.checkpoint import _flat_state, peer_shards
from adaptive.checkpoint._reading import CheckpointError, CheckpointInfo, MemoryCheckpoint
from adaptive.runtime import collectives, membership

__all__ = ["PeerCheckpoint", "send_states", "pass_states", "receive_states"]

logger = logging.getLogger(__name__)

#: Where a :class:`PeerCheckpoint` says it came from (it has no folder).
FROM_PEERS = Path("<peers>")


class PeerCheckpoint(MemoryCheckpoint):
    """The states rank 0 sent, in memory, read like a checkpoint; sharded parts are scattered by rank 0."""

    def __init__(self, info: CheckpointInfo, contents: dict[str, object], sharded: list[str] | None = None) -> None:
        super().__init__(info, contents, "the state sent by the running members")
        self._sent_sharded = list(sharded or [])

    def sharded_names(self) -> list[str]:
        return list(self._sent_sharded)

    def read_sharded(self, name: str, target: StateDict) -> StateDict:
        """``target`` filled from rank 0's full copy; collective: the members reshard the same state meanwhile."""
        if name not in self._sent_sharded:
            raise CheckpointError(f"state {name!r} has no sharded part among those the running members send")
        return peer_shards.fill_from_rank0(target, None)


def send_states(contents: dict[str, object], seq: int, metadata: JSON, sharded: list[str] | None = None) -> int:
    """On the new rank 0: send ``contents`` (state name -> state dict) to the joiners; the bytes sent.

    ``sharded`` names the states whose sharded part the members reshard
    right after (the joiners read it through :meth:`PeerCheckpoint.read_sharded`).

    Rank 0 calls it, each joiner :func:`receive_states` and the other
    members :func:`pass_states`, on the control group.
    """
    packed = _flat_state.pack({"seq": seq, "metadata": metadata, "states": contents, "sharded": list(sharded or [])})
    _transfer(packed)
    return packed.numel()


def pass_states() -> None:
    """On a survivor that is not rank 0: nothing to do, rank 0 sends to the joiners only (see :func:`_transfer`)."""


def receive_states() -> PeerCheckpoint:
    """On a joiner: the states rank 0 sent, as a checkpoint to restore from."""
    started = time.perf_counter()
    tensor = _transfer(None)
    payload = _flat_state.unpack(tensor, "the state sent by the running members")
    info = CheckpointInfo(seq=int(payload["seq"]), path=FROM_PEERS, created=time.time(),
                          metadata=dict(payload["metadata"]), size=int(tensor.numel()))
    logger.info("received the training state from the running members: %d states, %.1f MB in %.3f s",
                len(payload["states"]), tensor.numel() / 1e6, time.perf_counter() - started)
    return PeerCheckpoint(info, dict(payload["states"]), list(payload.get("sharded", [])))


def _transfer(tensor: torch.Tensor | None) -> torch.Tensor:
    """Rank 0's ``tensor`` (uint8) on each joiner, sent point to point over the control group.

    The other members take no part, and rank 0 posts its sends to every
    joiner before it waits for any: a loss during the hand-over (a joiner,
    rank 0, another member) must leave no one waiting here for a peer that
    gave the hand-over up, for that peer does not close its connections
    until the members that are left re-formed (which needs everyone there).
    """
    group = collectives.control_group()
    failures: list[BaseException] = []
    if tensor is not None:
        generation = membership.membership().generation
        assert generation is not None, "the hand-over runs in a live generation"
        joiners = [generation.rank_of(wid) for wid in generation.joiners]
        for payload in (torch.tensor([tensor.numel()], dtype=torch.int64), tensor):
            works = []
            for rank in joiners:
                try:
                    works.append(dist.isend(payload, dst=rank, group=group))
                except (RuntimeError, dist.DistError) as error:
                    failures.append(error)
            for work in works:
                try:
                    if work is not None:  # isend returns None to a rank outside the group (never here)
                        work.wait()
                except (RuntimeError, dist.DistError) as error:
                    failures.append(error)
        out = tensor
    else:
        try:
            size = torch.empty(1, dtype=torch.int64)
            dist.recv(size, src=0, group=group)
            out = torch.empty(int(size.item()), dtype=torch.uint8)
            dist.recv(out, src=0, group=group)
        except (RuntimeError, dist.DistError) as error:
            failures.append(error)
    if failures:
        raise collectives.CollectiveError(f"handing the training state to the joiners failed: {failures[0]}") \
            from failures[0]
    return out
