"""The live job's store: where it listens, who hosts it, and which job it serves.

Every membership decision of a live job (``adaptive-run --live``) goes
through one TCPStore on the rendezvous endpoint.  The first launcher on the
endpoint's machine hosts it (:func:`host_or_connect`), the others connect.

* **It listens on the endpoint's address only.**  torch's TCPStore server
  binds to every interface; here the launcher binds the listening socket
  itself to the endpoint's address (127.0.0.1 stays on loopback, a host
  name binds to its interface) and hands it to the store.
* **One job per endpoint.**  The first launcher writes the job's identity
  (its job id, ``--rdzv-id``, script and arguments) on the store
  (:func:`claim_identity`); a launcher whose identity differs is refused
  before it starts a worker, with an error that names both, and ends with
  :data:`CONFIG_ERROR_EXIT_CODE` (a restart cannot fix it).

* **Its records are signed** when the job has a secret
  (``ADAPTIVE_LIVE_SECRET``, :mod:`adaptive.runtime.signed_records`); the
  identity too, so a launcher given another secret is refused like a
  launcher of another job.  Without one, a store on an address other
  machines can reach is named in one warning (:func:`warn_if_unsigned`).

What a process that reaches the port can do is described in
``docs/live.md`` ("Who can write to the job's store").
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import ipaddress
import json
import logging
import socket
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    import torch.distributed

__all__ = ["JobIdentity", "HostedStore", "host_or_connect", "claim_identity", "IDENTITY_KEY",
           "CONFIG_ERROR_EXIT_CODE", "IdentityMismatch", "warn_if_unsigned", "is_loopback"]

logger = logging.getLogger(__name__)

#: Seconds a store client waits for an answer.
STORE_TIMEOUT = datetime.timedelta(seconds=60)
#: The key (on the launchers' store, outside every job's keys) of the identity of the job it serves.
IDENTITY_KEY = "adaptive/live-job/identity"
#: Exit status of a launcher that a restart cannot help (another job on the endpoint, a bad argument).
CONFIG_ERROR_EXIT_CODE = 2


@dataclasses.dataclass(frozen=True)
class JobIdentity:
    """What makes two launchers parts of one job: the same job id, ``--rdzv-id``, script and arguments."""

    job_id: str
    rdzv_id: str
    script: str
    args: tuple[str, ...]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> JobIdentity:
        data = json.loads(text)
        return cls(str(data["job_id"]), str(data["rdzv_id"]), str(data["script"]), tuple(data["args"]))

    def differences(self, other: JobIdentity) -> list[str]:
        """The fields in which ``other`` differs, each as ``name: mine vs other``."""
        return [f"{field.name}: {getattr(self, field.name)!r} here, {getattr(other, field.name)!r} in the job"
                for field in dataclasses.fields(self) if getattr(self, field.name) != getattr(other, field.name)]


class IdentityMismatch(SystemExit):
    """A launcher of another job (or of the same script with other arguments) found this endpoint in use."""


@dataclasses.dataclass
class HostedStore:
    """The launchers' store and whether this launcher hosts it (and then the socket it listens on)."""

    store: torch.distributed.Store
    hosting: bool
    listener: socket.socket | None = None


def is_this_machine(host: str) -> bool:
    """Whether ``host`` names an address of this machine (one a socket here can bind to)."""
    return _bindable_address(host) is not None


def _bindable_address(host: str) -> tuple[socket.AddressFamily, str] | None:
    """The first address of ``host`` a socket here can bind to, with its family; None when none."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return None
    for family, _, _, _, address in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.bind((address[0], 0))
            return family, str(address[0])
        except OSError:
            continue
    return None


def _listen(host: str, port: int) -> socket.socket | None:
    """A socket listening on ``host``'s address and ``port``; None when ``host`` is not an address of this
    machine, or another process holds the port."""
    found = _bindable_address(host)
    if found is None:
        return None
    family, address = found
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((address, port))
    except OSError as error:
        listener.close()
        if error.errno == errno.EADDRINUSE:
            return None
        raise
    listener.listen(socket.SOMAXCONN)
    return listener


def host_or_connect(host: str, port: int) -> HostedStore:
    """The job's TCPStore: hosted here, listening on ``host``'s address only, when the endpoint is this
    machine's and free; else the one another launcher hosts (a launcher on another machine never hosts: its
    own free port is not the endpoint)."""
    import torch.distributed as dist

    listener = _listen(host, port)  # None when the endpoint is not this machine's, or another launcher hosts
    if listener is not None:
        store = dist.TCPStore(host, port, is_master=True, timeout=STORE_TIMEOUT, wait_for_workers=False,
                              master_listen_fd=listener.fileno())
        return HostedStore(store, True, listener)
    return HostedStore(dist.TCPStore(host, port, is_master=False, timeout=STORE_TIMEOUT, wait_for_workers=False),
                       False)


def claim_identity(store: torch.distributed.Store, mine: JobIdentity) -> None:
    """Write this job's identity on the store, or check that the job there is this one (signed with the job's
    secret when it has one: a launcher with another secret, or without one, is refused).

    Raises:
        IdentityMismatch: the store serves another job, or one with another secret (exit status
            :data:`CONFIG_ERROR_EXIT_CODE`).
    """
    from adaptive.runtime import env, signed_records

    secret = env.live_secret()
    record = mine.to_json() if secret is None else signed_records.sign(secret, IDENTITY_KEY, mine.to_json()).decode()
    held = store.compare_set(IDENTITY_KEY, "", record)
    text = held if secret is None else signed_records.verify(secret, IDENTITY_KEY, held)
    if text is None or (secret is None and held.startswith(signed_records.MARK)):
        what = "signs its records with a secret" if secret is None else "has records this launcher cannot " \
            "authenticate (another secret)"
        _refuse(f"the job on this --rdzv-endpoint {what}: give every launcher of the job the same "
                f"{env.LIVE_SECRET_VAR} (or {env.LIVE_SECRET_FILE_VAR}), or this job its own endpoint")
    theirs = JobIdentity.from_json(text)
    differences = mine.differences(theirs)
    if differences:
        _refuse("the store on this --rdzv-endpoint serves another job (" + "; ".join(differences) + "); give this "
                "job its own endpoint (or the same --rdzv-id, script and arguments to join that one)")


def _refuse(why: str) -> NoReturn:
    """Log ``why`` this launcher cannot join the job on the endpoint, and end it with 2.

    Raises:
        IdentityMismatch: always.
    """
    logger.error("adaptive-run --live: %s", why)
    raise IdentityMismatch(CONFIG_ERROR_EXIT_CODE)


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback address (no other machine reaches it)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)


def warn_if_unsigned(host: str, port: int) -> None:
    """Say once, at a launcher's start, that the job's records are not signed when its store listens on an
    address other machines may reach (on loopback only this machine's processes reach it)."""
    from adaptive.runtime import env

    if env.live_secret() is not None or is_loopback(host):
        return
    logger.warning("adaptive-run --live: the job's store on %s:%d has no secret: any process that can reach that "
                   "port can write the job's membership records (take members for dead, admit processes, drain "
                   "nodes, end generations); set %s (or %s, a file) to the same secret for every launcher of the "
                   "job", host, port, env.LIVE_SECRET_VAR, env.LIVE_SECRET_FILE_VAR)
