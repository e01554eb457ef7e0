"""A peer replica's death, reported as one line per rank instead of a backend traceback.

When a replica dies (SIGKILL, a lost node), whatever collective the others
are in fails: the library's own agreements raise
:class:`~adaptive.runtime.collectives.CollectiveError`, and the user's own
collectives (DDP's gradient all-reduce, FSDP2's all-gather,
``clip_grad_norm_`` over DTensors) raise the backend's error, a
``RuntimeError`` from gloo (``Connection reset by peer``) or a
``DistBackendError`` from NCCL, from wherever the script was. Either way the
right outcome is the same: exit without writing a checkpoint, so that the
last complete one stays the newest and the restarted group resumes from it.

:func:`install` (called by :func:`~adaptive.runtime.collectives.init_process_group`)
sets a ``sys.excepthook`` that recognises such an error when it ends the
script, logs one line naming the cause, keeps the traceback in the DEBUG log
and lets the process exit with status 1. Any other error goes to the previous
hook unchanged. Either way the job learns that an error, not a ``break``,
left its loops (:func:`adaptive.elastic.epoch.warn_if_left_early`).
"""

from __future__ import annotations

import logging
import re
import sys
from types import TracebackType
from typing import Callable

from adaptive.runtime import env, membership, step
from adaptive.runtime.errors import CollectiveError
from adaptive.runtime.job import current_job

__all__ = ["install", "is_peer_failure", "report", "absorb_in_live_mode"]

logger = logging.getLogger(__name__)

#: What gloo and NCCL say when a peer went away (checked in the error and its causes).
_PEER_GONE = re.compile(r"Connection reset by peer|Connection closed by peer|Broken pipe|gloo/transport|"
                        r"NCCL communicator was aborted|remote process exited|ProcessGroupGloo.*(timed out|Timed out)|"
                        r"peer replica failed|a peer died")

#: The excepthook installed before :func:`install`'s, called for every error that is not a lost peer.
_installed: dict[str, Callable[[type[BaseException], BaseException, TracebackType | None], object]] = {}

#: Why a live job restarts from the checkpoint after all: the loss came where it cannot be recovered in memory.
_LIVE_RESTART = ("; the live job's members restart from it, since the loss broke a collective that cannot be "
                 "discarded in memory (a checkpoint being written, code outside the loader's loops, or a sharded "
                 "model's mesh on NCCL)")


def is_peer_failure(error: BaseException | None) -> bool:
    """Whether ``error`` (or an error it was raised from) is a collective broken by a lost peer."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if _is_distributed_error(error) or (isinstance(error, RuntimeError) and _PEER_GONE.search(str(error))):
            return True
        error = error.__cause__ or error.__context__
    return False


def absorb_in_live_mode(error: BaseException) -> bool:
    """Live mode: record a lost peer on the step in flight instead of raising; whether it was recorded.

    The step is then discarded and the loader re-forms the members that are
    left (:func:`adaptive.elastic.live.recover`).  Outside live mode, or for
    an error that is not a lost peer, nothing is recorded and the caller
    raises.
    """
    if not (membership.is_live() and is_peer_failure(error)):
        return False
    step.record_fault(error)
    return True


def _is_distributed_error(error: BaseException) -> bool:
    if isinstance(error, CollectiveError):
        return True
    try:
        from torch.distributed import DistError
    except ImportError:  # older torch
        return False
    return isinstance(error, DistError)


def report(error: BaseException) -> None:
    """Log the one line (ERROR) and keep the traceback (DEBUG) for a peer failure that ends this process."""
    current_job().exiting = True  # not a deliberate break out of the epoch loop
    membership.mark_failed()  # live mode: whoever waits to join this generation forms the next one
    if membership.is_live() and _is_store_loss(error):
        logger.error("rank %d: the live job's store does not answer (%s: the node that hosted it was lost?); "
                     "exiting without writing a checkpoint, and this node's launcher ends with 75 so that a "
                     "relaunch resumes from the last complete one (in %s)", env.rank(), _cause(error),
                     env.checkpoint_path())
    else:
        logger.error("rank %d: a peer replica failed (%s); exiting without writing a checkpoint so that the "
                     "last complete one (in %s) stays the newest%s", env.rank(), _cause(error),
                     env.checkpoint_path(), _LIVE_RESTART if membership.is_live() else "")
    logger.debug("the failed collective", exc_info=(type(error), error, error.__traceback__))


def _is_store_loss(error: BaseException) -> bool:
    """Whether ``error`` is a call to the store that failed on its connection (TCPStore raises
    ``DistNetworkError``; a collective's broken peer is a ``DistBackendError`` or gloo's ``RuntimeError``)."""
    try:
        from torch.distributed import DistNetworkError
    except ImportError:  # older torch
        return False
    return isinstance(error, DistNetworkError)


def _cause(error: BaseException) -> str:
    """The innermost error's type and first sentence, without the backend's source path."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    text = re.sub(r"\[[^\]]*/third_party/([^\]]*)\] ?", "", text).split(". ")[0]
    return f"{type(error).__name__}: {text[:200]}" if text else type(error).__name__


def _hook(kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> None:
    current_job().exiting = True  # an error ended the script: it did not break out of its loops
    if is_peer_failure(error):
        report(error)
        return
    _installed["previous"](kind, error, trace)


def install() -> None:
    """Report peer failures that end the script as one line (once per process; chains to the previous hook).

    Once: ``torch.distributed.init_process_group`` (every live regroup calls
    it) wraps the excepthook it finds, ours included, so installing again
    would make ours chain to a hook that calls ours (a recursion).
    """
    if sys.excepthook is _hook or "previous" in _installed:
        return
    _installed["previous"] = sys.excepthook
    sys.excepthook = _hook
