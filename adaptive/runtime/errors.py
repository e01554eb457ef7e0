"""The runtime's one error type: a collective that could not complete.

Kept apart from :mod:`.collectives` so that :mod:`.peer_failure`, which
recognises it, and :mod:`.collectives`, which raises it, do not import each
other.
"""

from __future__ import annotations

__all__ = ["CollectiveError"]


class CollectiveError(RuntimeError):
    """A collective failed: a peer died, hung past the timeout, or the group broke."""
