"""The boundaries of a loader's loop: what happens between two steps, decided in one place.

Between two steps of an ``AdaptiveDataLoader`` loop the elastic runtime may
have to act: agree with the other replicas (a stop, a checkpoint, a live
membership change, :mod:`adaptive.elastic.sync_points`), or, when a live
member was lost, re-form without it and go back to the last committed step
(:mod:`adaptive.elastic.live`), or end the process for the restart path
when that cannot be done in memory.  :class:`LoopBoundaries` does all of
that for one pass of a loop, so that the loader itself only plans and
yields steps: it asks :meth:`LoopBoundaries.cross` for the next step,
after each step whether it was lost (:meth:`LoopBoundaries.step_lost`), and
says when it committed one (:meth:`LoopBoundaries.step_committed`).

A loss can surface at any collective of a boundary (the agreement, a
change, the batch-size decision, the agreement before a
loop's last step or after it ends); wherever it does, :meth:`cross` goes
back to the boundary, re-forms, and plans again from the committed
position.
"""

from __future__ import annotations

import logging
from typing import Callable, TypeVar

from adaptive.elastic import live, sync_points
from adaptive.elastic.stopping import PEER_FAILED_EXIT_CODE
from adaptive.runtime import membership, peer_failure
from adaptive.runtime.step import discarded, faulted, stream

__all__ = ["LoopBoundaries"]

logger = logging.getLogger(__name__)

StepT = TypeVar("StepT")


class LoopBoundaries:
    """The boundaries of one pass of a loader's loop.

    Args:
        metadata: the loop's position, for a checkpoint's manifest.
        where: the loop in progress (epoch, loader, loop): the states kept at a
            live commit point are good for their own loop only.
    """

    def __init__(self, metadata: sync_points.Metadata, where: Callable[[], tuple[object, ...]]) -> None:
        self._metadata = metadata
        self._where = where
        self._planned = False  # whether the pass planned a step (a loss before that finds the loop untrained)
        self._after_last = False  # whether the step just trained was the loop's last
        self._generation: int | None = None  # the live generation it last planned in (None: not live)

    def cross(self, decide: Callable[[bool], None],
              next_step: Callable[[], tuple[StepT, bool] | None]) -> StepT | None:
        """Cross the boundary before the loop's next step: the step to train, or None when the loop ended.

        Args:
            decide: the loader's own work at a boundary (timing, a batch-size
                decision), called with whether this is the first boundary of
                the pass or of a new membership; it may record a loss.
            next_step: the next planned step and whether it is the loop's
                last, or None when the plan is done; the loader plans anew
                from the committed position when the membership changed.
        """
        first = not self._planned
        while True:
            if not faulted():
                first = self._agree(first)
            while faulted():  # live mode: a member was lost; those left go back to the last committed step
                self._recover()
                first = True
            if first:  # live mode: what a loss before the next committed step goes back to
                live.keep_commit_point(self._where())
            decide(first)
            if faulted():  # a member was lost while the batch size was agreed
                continue
            planned = next_step()
            self._planned, self._generation = True, membership.generation_number()
            if planned is None:
                sync_points.final_boundary(self._metadata)
                if faulted():  # a member was lost at the loop's end: its last steps are trained again
                    continue
                return None
            step, last = planned
            self._after_last = last
            if last and not first:
                # A stop known now is taken before the loop's last step, so that a replay runs that step
                # (and the loop body that binds its variables) again.
                sync_points.settle(self._metadata, recoverable=True)
                if faulted():
                    continue
            return step

    def step_lost(self) -> bool:
        """After a step's micro-batches: whether a live member was lost before every member applied it (it is
        discarded, not committed, and :meth:`cross` goes back).  A step whose update every member applied
        counts as trained, even when a member was lost after it (:mod:`adaptive.runtime.step_commit`)."""
        return discarded()

    def step_committed(self) -> None:
        """The loader committed a step: in a live job, what a loss goes back to from now on."""
        live.keep_commit_point(self._where())

    def _agree(self, first: bool) -> bool:
        """The agreement at this boundary; whether it is a first one (of the pass, or of a new membership)."""
        if first:  # a stop that arrived between loops is acted on before the first step
            self._settle_first()
            return True
        sync_points.step_boundary(self._metadata, loop_ends=self._after_last)
        if self._generation != membership.generation_number() and not faulted():
            # Live mode: the membership changed here. The joiners enter this loop now; the boundary is the
            # first of the new generation, for the members that stayed too.
            self._settle_first()
            return True
        return False

    def _settle_first(self) -> None:
        """Agree at a first boundary (of the pass, of a new membership, of the re-formed job) and make at once a
        membership change agreed there or carried from the last loop's end, then agree again as the new
        generation's first boundary.

        Every member and every joiner settles here alike (a joiner's first agreement is the members' first
        after the change that admitted it), so all of them make the same changes at the same agreement: a change
        made by some and put off by others would leave them in different collectives.  Each round admits or
        lets go of somebody, so the rounds are bounded by the processes asking.
        """
        sync_points.settle(self._metadata, recoverable=True)
        while not faulted() and sync_points.make_agreed_change(self._metadata):
            sync_points.settle(self._metadata, recoverable=True)  # returns at once if the change lost somebody

    def _recover(self) -> None:
        """Live mode: re-form without the lost member and go back to the last committed step, or end this process."""
        error = stream().fault
        if not live.recover(self._where(), loop_untrained=not self._planned):
            assert error is not None
            peer_failure.report(error)
            raise SystemExit(PEER_FAILED_EXIT_CODE) from error
        sync_points.forget_decisions()
        self._settle_first()  # the first boundary of the re-formed job
