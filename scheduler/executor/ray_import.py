"""Importing the optional ``ray`` dependency, with an error that says how to get it.

The Ray backend is an extra (``pip install "adaptive-elastic[ray]"``); the
local backend and the rest of the scheduler never import ``ray``.
"""

from __future__ import annotations

import logging
from types import ModuleType

logger = logging.getLogger(__name__)

INSTALL_HINT = 'pip install "adaptive-elastic[ray]"'


class RayNotInstalledError(ImportError):
    """``ray`` is needed (the Ray backend) but cannot be imported."""


def import_ray() -> ModuleType:
    """The ``ray`` module, or :class:`RayNotInstalledError` naming the extra to install."""
    try:
        import ray
    except ImportError as exc:
        raise RayNotInstalledError(
            f"the Ray backend needs the 'ray' package, which is not installed ({exc}); "
            f"install it with: {INSTALL_HINT}") from exc
    return ray
