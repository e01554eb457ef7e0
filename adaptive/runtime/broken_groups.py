"""Process groups of a generation that lost a member: kept alive until their collectives time out, never joined.

Destroying a gloo process group joins its worker threads, and a thread still
inside a collective of a group that lost a member returns only at the
collective timeout (``ADAPTIVE_COLLECTIVE_TIMEOUT``, 300 s by default):
gloo passes data from member to member, and a member that saw the loss first
sends nothing more to the others, which are alive but wait.  Calling
``abort()`` on a gloo group does not end those waits.  If the members that
re-form after the loss destroyed their old groups, each would wait in the
destructor, and two members whose threads wait for each other would both
wait out the whole timeout before training again (seen as a 60 s recovery
with three members and loader workers).

So a broken group is not destroyed: :func:`keep` holds it (and whatever else
must not be freed with it) for its timeout plus a margin, and later calls
drop the groups whose time has passed (their threads are idle by then, so
dropping them is instant).  Groups still held when the process exits are
left to the operating system on purpose: Python would otherwise destroy them
at interpreter teardown and wait there for their threads.
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import logging
import time

__all__ = ["keep", "release_expired", "held"]

logger = logging.getLogger(__name__)

#: Seconds a kept group is held beyond its collective timeout.
MARGIN = 5.0


@dataclasses.dataclass
class _Kept:
    objects: tuple[object, ...]
    until: float  # monotonic


_kept: list[_Kept] = []
_exit_hook: list[bool] = []


def keep(*objects: object, timeout: float) -> None:
    """Hold ``objects`` (process groups of a broken generation) until ``timeout`` seconds and a margin passed."""
    release_expired()
    live = tuple(obj for obj in objects if obj is not None)
    if not live:
        return
    _kept.append(_Kept(live, time.monotonic() + timeout + MARGIN))
    if not _exit_hook:
        atexit.register(_leave_to_the_system)
        _exit_hook.append(True)
    logger.debug("keeping %d object(s) of a broken generation for %.0f s", len(live), timeout + MARGIN)


def release_expired() -> int:
    """Drop the kept objects whose collectives have timed out by now; how many entries were dropped."""
    now = time.monotonic()
    expired = [entry for entry in _kept if entry.until <= now]
    _kept[:] = [entry for entry in _kept if entry.until > now]
    return len(expired)


def held() -> int:
    """How many objects are held now."""
    return sum(len(entry.objects) for entry in _kept)


def _leave_to_the_system() -> None:
    """At exit: never destroy the groups still held (their threads may still wait; the process is ending)."""
    release_expired()
    for entry in _kept:
        for obj in entry.objects:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))  # one reference no teardown gives back
    if _kept:
        logger.debug("left %d object(s) of broken generations to the operating system at exit", held())
