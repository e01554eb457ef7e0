"""A store whose blocking waits give up as soon as the live generation lost a member.

A live generation's process group is built by ``init_process_group`` on the
job's store: each member waits there for the others' addresses, for as long
as the group's timeout (a collective's: minutes).  The members met on the
store just before (:func:`adaptive.runtime.reforming.meet`), but a member can
still die between that meeting and the group's rendezvous (a machine lost
takes several workers a few milliseconds apart).  Without this wrapper the
members that are left would wait the whole timeout in torch's rendezvous.

:class:`LossWatchedStore` turns every blocking wait (``wait``, and ``get``
of an absent key) into looks at the store (:class:`adaptive.runtime.membership.Poll`:
a millisecond apart at first, at most 10 ms) and asks a predicate between two
of them (:func:`adaptive.runtime.reforming.loss_reported`: a member said so,
its launcher reported it dead, or it hung); once it answers yes, the wait
fails with :class:`torch.distributed.DistStoreError`, the rendezvous fails
with it, and the members that are left re-form without the lost one.
(Looks, rather than the store's own waits cut in slices: torch logs a
warning for every slice that ends at its timeout.)
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from typing import cast

import torch.distributed as dist

from adaptive.runtime.membership import Poll

__all__ = ["LossWatchedStore"]


class LossWatchedStore(dist.Store):
    """``store``, whose blocking waits fail once ``lost()`` says a member is gone (module docstring).

    Args:
        store: the store waited on (a ``PrefixStore`` of the generation's group keys).
        lost: asked between two looks at the store during a wait; True ends the wait with an error.
        what: what a loss means, for the error's message (e.g. "generation 4 lost a member").
    """

    def __init__(self, store: dist.Store, lost: Callable[[], bool], what: str) -> None:
        super().__init__()
        self.store, self._lost, self._what = store, lost, what
        # The clones handed to torch: a store written in Python lives on in C++ only while Python holds it.
        self._clones: list[LossWatchedStore] = []

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        """Wait until every key of ``keys`` exists (at most ``timeout``, default the store's).

        Raises:
            torch.distributed.DistStoreError: they did not within the timeout, or a member was lost meanwhile.
        """
        seconds = (timeout or self.timeout).total_seconds()
        deadline = time.monotonic() + seconds
        poll = Poll()
        while not self.store.check(list(keys)):
            if self._lost():
                raise dist.DistStoreError(f"gave up waiting for {list(keys)} on the store: {self._what}")
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"keys {list(keys)} were not set within {seconds:.0f} s")
            poll.sleep()

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting (as :meth:`wait`, the store's timeout) while it is absent."""
        self.wait([key])
        return bytes(self.store.get(key))

    def set(self, key: str, value: str | bytes) -> None:
        self.store.set(key, value)  # type: ignore[arg-type]  # (bytes too: the stub says str)

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        return bytes(self.store.compare_set(key, expected_value, desired_value))  # type: ignore[arg-type]

    def add(self, key: str, value: int) -> int:
        return int(self.store.add(key, value))

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self.store.check(list(keys)))

    def delete_key(self, key: str) -> bool:
        return bool(self.store.delete_key(key))

    def num_keys(self) -> int:
        return int(self.store.num_keys())

    def clone(self) -> LossWatchedStore:
        """A store of its own connection, watched alike (gloo gives each of its connections one)."""
        clone = LossWatchedStore(getattr(self.store, "clone")(), self._lost, self._what)  # (not in the stub)
        self._clones.append(clone)
        return clone

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.store.set_timeout(timeout)

    @property
    def timeout(self) -> datetime.timedelta:
        """The wrapped store's timeout: how long a blocking call waits."""
        return cast(datetime.timedelta, getattr(self.store, "timeout"))  # (not in the stub)
