"""The supervisor's HTTP API: jobs report hints and read their allocation.

Endpoints (JSON bodies; every one but ``/v1/health`` needs the header
``Authorization: Bearer <token>``)::

    GET    /v1/health                    {"status": "ok"}
    GET    /v1/jobs                      {"jobs": {id: record}}
    PUT    /v1/jobs/<id>                 register: {"min_replicas", "max_replicas", "preemptible", "submission_time"}
    DELETE /v1/jobs/<id>                 forget a job
    POST   /v1/jobs/<id>/hints           report hints (adaptive.goodput.hints JSON; its job_id must be <id>)
    GET    /v1/jobs/<id>/hints           the latest hints, or null
    GET    /v1/jobs/<id>/allocation      {"job_id", "allocation": [node, ...], "num_replicas", "version"}

Bodies are limited to :data:`MAX_BODY_BYTES`, must be ``application/json``
with a ``Content-Length``; bad input gets ``400`` with ``{"error": ...}``
naming the problem, unknown jobs ``404``, a missing or wrong token ``401``.
The server binds to 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from scheduler.supervisor.state import SupervisorState, validate_job_id

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024
_ROUTE = re.compile(r"^/v1/jobs/(?P<job>[^/]+)(?P<sub>/hints|/allocation)?$")


class ApiError(Exception):
    """An error answered to the client with ``status`` and a message."""

    def __init__(self, status: HTTPStatus, message: str):
        super().__init__(message)
        self.status = status


class _Handler(BaseHTTPRequestHandler):
    """Routes requests to the :class:`SupervisorState` of its server."""

    server: "_Server"
    protocol_version = "HTTP/1.1"
    timeout = 10  # seconds a client may take to send its request

    # --------------------------------------------------------------- plumbing
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        logger.debug("%s %s", self.address_string(), format % args)

    def _send(self, status: HTTPStatus, body: Any = None) -> None:
        payload = b"" if body is None else json.dumps(body).encode("utf-8")
        self.send_response(status)
        if status == HTTPStatus.UNAUTHORIZED:
            self.send_header("WWW-Authenticate", 'Bearer realm="scheduler"')
        if status >= 400:  # the request body may be unread: do not reuse the connection
            self.close_connection = True
            self.send_header("Connection", "close")
        if payload:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _authorized(self) -> bool:
        header = self.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return False
        return hmac.compare_digest(token.strip().encode("utf-8"), self.server.token)

    def _read_json(self) -> Any:
        if self.headers.get("Transfer-Encoding"):
            raise ApiError(HTTPStatus.LENGTH_REQUIRED, "chunked bodies are not accepted; send Content-Length")
        length_header = self.headers.get("Content-Length")
        if length_header is None:
            raise ApiError(HTTPStatus.LENGTH_REQUIRED, "Content-Length is required")
        try:
            length = int(length_header)
        except ValueError:
            raise ApiError(HTTPStatus.BAD_REQUEST, f"bad Content-Length {length_header!r}") from None
        if length < 0 or length > MAX_BODY_BYTES:
            raise ApiError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                           f"body of {length} bytes exceeds the limit of {MAX_BODY_BYTES}")
        ctype = self.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            self.rfile.read(length)
            raise ApiError(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, "Content-Type must be application/json")
        raw = self.rfile.read(length)
        try:
            return json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ApiError(HTTPStatus.BAD_REQUEST, f"body is not valid JSON: {exc}") from None

    def _route(self) -> tuple[str, str | None]:
        """``(kind, job_id)``: kind is health, jobs, job, hints or allocation."""
        path = self.path.split("?", 1)[0]
        if path == "/v1/health":
            return "health", None
        if path == "/v1/jobs":
            return "jobs", None
        match = _ROUTE.match(path)
        if not match:
            raise ApiError(HTTPStatus.NOT_FOUND, f"no such endpoint {path!r}")
        try:
            job_id = validate_job_id(match.group("job"))
        except ValueError as exc:
            raise ApiError(HTTPStatus.BAD_REQUEST, str(exc)) from None
        return (match.group("sub") or "/job").lstrip("/"), job_id

    def _dispatch(self, method: str) -> None:
        # each takes the route's job id (None for the collection)
        handlers: dict[tuple[str, str], Callable[[Any], None]] = {
            ("GET", "jobs"): self._get_jobs, ("PUT", "job"): self._put_job,
            ("DELETE", "job"): self._delete_job, ("POST", "hints"): self._post_hints,
            ("GET", "hints"): self._get_hints, ("GET", "allocation"): self._get_allocation}
        try:
            kind, job_id = self._route()
            if kind == "health" and method == "GET":
                return self._send(HTTPStatus.OK, {"status": "ok"})
            if kind != "health" and not self._authorized():
                raise ApiError(HTTPStatus.UNAUTHORIZED, "missing or wrong bearer token")
            handler = handlers.get((method, kind))
            if handler is None:
                raise ApiError(HTTPStatus.METHOD_NOT_ALLOWED, f"{method} is not allowed on {self.path}")
            handler(job_id)
        except ApiError as exc:
            self._send(exc.status, {"error": str(exc)})
        except KeyError:
            self._send(HTTPStatus.NOT_FOUND, {"error": "unknown job id; register it first with PUT /v1/jobs/<id>"})
        except ValueError as exc:
            self._send(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
        except Exception:  # noqa: BLE001 - answer 500 and keep serving
            logger.exception("supervisor request %s %s failed", method, self.path)
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": "internal error"})

    def do_GET(self) -> None:  # noqa: N802 - stdlib naming
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._dispatch("PUT")

    def do_DELETE(self) -> None:  # noqa: N802
        self._dispatch("DELETE")

    def do_PATCH(self) -> None:  # noqa: N802 - answered 405 in JSON rather than the stdlib's HTML 501
        self._dispatch("PATCH")

    # --------------------------------------------------------------- handlers
    def _get_jobs(self, _job_id: None) -> None:
        jobs = {k: v.public() for k, v in self.server.state.jobs().items()}
        self._send(HTTPStatus.OK, {"jobs": jobs})

    def _put_job(self, job_id: str) -> None:
        record = self.server.state.register_job(job_id, self._read_json())
        self._send(HTTPStatus.OK, record.public())

    def _delete_job(self, job_id: str) -> None:
        self.server.state.remove_job(job_id)
        self._send(HTTPStatus.NO_CONTENT)

    def _post_hints(self, job_id: str) -> None:
        body = self._read_json()
        if not isinstance(body, dict):
            raise ValueError(f"hints must be a JSON object, got {type(body).__name__}")
        self.server.state.job(job_id)  # unknown ids: 404 before validating the body
        self.server.state.update_hints(job_id, body)
        self._send(HTTPStatus.NO_CONTENT)

    def _get_hints(self, job_id: str) -> None:
        self._send(HTTPStatus.OK, {"job_id": job_id, "hints": self.server.state.job(job_id).hints})

    def _get_allocation(self, job_id: str) -> None:
        allocation, version = self.server.state.allocation(job_id)
        self._send(HTTPStatus.OK, {"job_id": job_id, "allocation": list(allocation),
                                   "num_replicas": len(allocation), "version": version})


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], state: SupervisorState, token: bytes):
        self.state = state
        self.token = token
        super().__init__(address, _Handler)


class SupervisorServer:
    """Serves a :class:`SupervisorState` over HTTP in a background thread.

    Args:
        state: the shared state.
        token: shared secret clients send as ``Authorization: Bearer <token>``
            (at least 16 characters).
        host: interface to bind (loopback by default).
        port: TCP port (0 picks a free one; see :attr:`port`).
    """

    def __init__(self, state: SupervisorState, token: str, host: str = "127.0.0.1", port: int = 0):
        if not isinstance(token, str) or len(token.strip()) < 16:
            raise ValueError("token must be a string of at least 16 characters")
        self._server = _Server((host, port), state, token.strip().encode("utf-8"))
        self._thread: threading.Thread | None = None
        if host not in ("127.0.0.1", "localhost", "::1"):
            logger.warning("supervisor listening on %s: reachable from other machines", host)

    @property
    def host(self) -> str:
        return str(self._server.server_address[0])

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "SupervisorServer":
        """Start serving in a daemon thread."""
        self._thread = threading.Thread(target=self._server.serve_forever, name="supervisor-http",
                                        kwargs={"poll_interval": 0.2}, daemon=True)
        self._thread.start()
        logger.info("supervisor serving on %s", self.url)
        return self

    def stop(self) -> None:
        """Stop serving and release the port."""
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> "SupervisorServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
