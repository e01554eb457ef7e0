"""Posting a job's scheduler hints to the cluster scheduler over HTTP.

The hints themselves, their JSON format and the ``hints.json`` file are
shared with the scheduler and live in the torch-free :mod:`adaptive.goodput.hints`.
Sending them is only the running job's business: the batch-size controller
(:meth:`adaptive.batchsize.autoscale.BatchSizeController.report_hints`)
writes the file and, when a scheduler URL is configured, calls
:func:`post_hints`.
"""

from __future__ import annotations

import logging
import urllib.request

from adaptive._utils.checks import check_float
from adaptive.goodput import Hints

__all__ = ["post_hints"]

logger = logging.getLogger(__name__)


def post_hints(url: str, hints: Hints, timeout: float = 5.0, token: str | None = None) -> None:
    """POST ``hints.to_json()`` to ``url`` (``application/json``).

    For the project's supervisor the URL is
    ``<supervisor>/v1/jobs/<job_id>/hints`` and ``token`` its bearer token.

    Raises ``OSError`` (including ``urllib.error.URLError``) when the
    scheduler cannot be reached or answers with an error status; callers
    that must not fail on a missing scheduler catch and log it.
    """
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"url must be an http(s) URL, got {url!r}")
    check_float("timeout", timeout, 0.0, strict_minimum=True)
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=hints.to_json().encode("utf-8"), method="POST", headers=headers)
    with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 (http(s) only)
        response.read()
    logger.debug("posted hints of job %s to %s", hints.job_id, url)
