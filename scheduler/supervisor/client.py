"""Client of the supervisor's HTTP API (stdlib only)."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from scheduler.cluster import Allocation

logger = logging.getLogger(__name__)


class SupervisorError(RuntimeError):
    """The supervisor answered with an error status."""

    def __init__(self, status: int, message: str):
        super().__init__(f"supervisor error {status}: {message}")
        self.status = status
        self.message = message


class SupervisorClient:
    """Talks to a :class:`~scheduler.supervisor.server.SupervisorServer`.

    Args:
        url: base URL, e.g. ``http://127.0.0.1:8470``.
        token: the shared bearer token.
        timeout: seconds per request.
    """

    def __init__(self, url: str, token: str, timeout: float = 10.0):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {url!r}")
        self.url = url.rstrip("/")
        self._token = token
        self.timeout = timeout

    def _request(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode("utf-8")
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {self._token}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                message = json.loads(raw.decode("utf-8")).get("error", "")
            except (ValueError, AttributeError):
                message = raw.decode("utf-8", "replace")
            raise SupervisorError(exc.code, message) from None
        return json.loads(raw.decode("utf-8")) if raw else None

    def health(self) -> bool:
        return bool(self._request("GET", "/v1/health") == {"status": "ok"})

    def register_job(self, job_id: str, min_replicas: int = 0, max_replicas: int = 1,
                     preemptible: bool = True, submission_time: float | None = None) -> dict[str, Any]:
        spec: dict[str, Any] = {"min_replicas": min_replicas, "max_replicas": max_replicas,
                                "preemptible": preemptible}
        if submission_time is not None:
            spec["submission_time"] = submission_time
        registered: dict[str, Any] = self._request("PUT", f"/v1/jobs/{job_id}", spec)
        return registered

    def remove_job(self, job_id: str) -> None:
        self._request("DELETE", f"/v1/jobs/{job_id}")

    def jobs(self) -> dict[str, Any]:
        jobs: dict[str, Any] = self._request("GET", "/v1/jobs")["jobs"]
        return jobs

    def post_hints(self, job_id: str, hints: Mapping[str, Any]) -> None:
        """Report hints (a dict in the ``adaptive.goodput.hints`` format)."""
        self._request("POST", f"/v1/jobs/{job_id}/hints", dict(hints))

    def get_hints(self, job_id: str) -> dict[str, Any] | None:
        hints: dict[str, Any] | None = self._request("GET", f"/v1/jobs/{job_id}/hints")["hints"]
        return hints

    def get_allocation(self, job_id: str) -> tuple[Allocation, int]:
        """``(allocation, version)``: node index per replica, and the decision number."""
        body = self._request("GET", f"/v1/jobs/{job_id}/allocation")
        return tuple(body["allocation"]), int(body["version"])
