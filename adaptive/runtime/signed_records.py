"""Live mode: the job's membership records on its store, signed with the job's secret and verified on every read.

Every membership decision of a live job goes through the launchers' TCPStore
(:mod:`adaptive.runtime.membership`), which any process that reaches its
port can write.  When the job has a secret (``ADAPTIVE_LIVE_SECRET`` or
``ADAPTIVE_LIVE_SECRET_FILE``, :func:`adaptive.runtime.env.live_secret`),
the modules that read and write those records do it through a
:class:`SignedStore` (:func:`wrap`), a store whose

* ``set`` and ``compare_set`` write each value with an HMAC-SHA256 of the
  key (the whole key, the job's prefix included) and the value, so a value
  copied to another key, or written by anyone without the secret, does not
  verify;
* ``get``, ``check`` and :meth:`SignedStore.read` verify it: a record that
  fails is treated as absent (a blocking ``get`` waits on for a valid one,
  ``compare_set`` on an absent key replaces it) and logged once per key, with
  a WARNING that names it;
* ``add`` is passed through unsigned: the store adds in place, so a counter
  cannot carry a signature.  The modules that count with it take a counter
  for a hint only, and decide on the signed records it points to (see
  ``docs/live.md``, "Who can write to the job's store").

Without a secret :func:`wrap` returns the store itself: nothing is signed,
nothing costs more.  The process groups' own rendezvous keys (torch's) are
not records of ours and are never signed.

What is written: ``hmac1:<64 hex digits>:<value>``.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import threading
import time
from typing import TYPE_CHECKING, cast

import torch.distributed as dist

from adaptive.runtime import env

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["SignedStore", "wrap", "unsigned", "is_signed", "read", "sign", "verify", "MARK", "REPLACE_ATTEMPTS"]

logger = logging.getLogger(__name__)

#: How a signed value starts.
MARK = b"hmac1:"
#: What a record's signature covers besides its key and value: records of no other use verify.
_DOMAIN = b"adaptive-live-record\0"
#: A value no signed record can hold: asking to swap it for itself reads a key without blocking and without
#: writing (``compare_set`` on an absent key with another expected value answers that value, writing nothing).
_ABSENT = b"\0adaptive-absent\0"
#: How often ``compare_set`` on an absent key tries to replace a record that fails authentication.
REPLACE_ATTEMPTS = 5
#: Seconds between looks while a blocking ``get`` or ``wait`` waits for a valid record.
_POLL = 0.01
#: The most keys whose authentication failures are logged (after that, one line says the rest are not).
_WARN_KEYS = 1000

_warned: set[str] = set()
_warned_lock = threading.Lock()


def _bytes(value: str | bytes) -> bytes:
    """``value`` as bytes (text as UTF-8)."""
    return value.encode() if isinstance(value, str) else bytes(value)


def _wire(data: bytes) -> str:
    """``data`` as the store's calls take it (they take bytes as well as text; torch's stubs name text only)."""
    return cast(str, data)


def sign(secret: bytes, key: str, value: str | bytes) -> bytes:
    """``value`` as a record of ``key`` (the whole key on the store) signed with ``secret``."""
    data = _bytes(value)
    tag = hmac.new(secret, _DOMAIN + key.encode() + b"\0" + data, hashlib.sha256).hexdigest().encode()
    return MARK + tag + b":" + data


def verify(secret: bytes, key: str, raw: bytes) -> bytes | None:
    """The value of record ``raw`` read at ``key`` (the whole key) when its signature is ``secret``'s for that
    key and value; None when it is not (forged, signed with another secret, or copied from another key)."""
    head = len(MARK) + 64
    if not raw.startswith(MARK) or len(raw) < head + 1 or raw[head:head + 1] != b":":
        return None
    value = raw[head + 1:]
    expected = sign(secret, key, value)[len(MARK):head]
    return value if hmac.compare_digest(raw[len(MARK):head], expected) else None


def _warn_once(key: str) -> None:
    """Log, once per key, that the record at ``key`` failed authentication and was ignored."""
    with _warned_lock:
        if key in _warned or len(_warned) > _WARN_KEYS:
            return
        _warned.add(key)
        full = len(_warned) > _WARN_KEYS
    logger.warning("ignoring the record %r on the live job's store: it fails authentication (not written with the "
                   "job's secret, %s); it changes nothing%s", key, env.LIVE_SECRET_VAR,
                   "; further failures are not logged" if full else "")


class SignedStore(dist.Store):
    """A store whose records are signed with the job's secret and verified on every read (module docstring).

    Args:
        store: the store the records are written to (a ``PrefixStore`` of the job's keys, or the launchers'
            store itself).
        secret: the job's secret.
        scope: the prefix ``store`` puts before every key (the job's:
            :func:`adaptive.runtime.live_protocol.job_prefix`), so that a signature covers the whole key; empty
            for a store without a prefix.
    """

    def __init__(self, store: dist.Store, secret: bytes, scope: str = "") -> None:
        super().__init__()
        if not secret:
            raise ValueError("secret must be a non-empty byte string")
        self.store, self._secret, self.scope = store, secret, scope

    def _full(self, key: str) -> str:
        """``key`` as the store holds it (with the prefix): what a signature covers."""
        return f"{self.scope}/{key}" if self.scope else key

    def _sign(self, key: str, value: str | bytes) -> bytes:
        """``value`` signed as a record of ``key``."""
        return sign(self._secret, self._full(key), value)

    def _open(self, key: str, raw: bytes) -> bytes | None:
        """The value of ``raw`` read at ``key``; None (logged once) when it fails authentication."""
        value = verify(self._secret, self._full(key), raw)
        if value is None:
            _warn_once(self._full(key))
        return value

    def _raw(self, key: str) -> bytes | None:
        """What ``key`` holds on the store, None when absent (one call, never blocks, writes nothing)."""
        held = self.store.compare_set(key, _wire(_ABSENT), _wire(_ABSENT))
        return None if held == _ABSENT else held

    # ---------------------------------------------------------------- the store's calls
    def set(self, key: str, value: str | bytes) -> None:
        self.store.set(key, _wire(self._sign(key, value)))

    def read(self, key: str) -> str | None:
        """The verified value of ``key``; None when it is absent or fails authentication (never blocks)."""
        raw = self._raw(key)
        value = None if raw is None else self._open(key, raw)
        return None if value is None else value.decode()

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key of ``keys`` holds a record that verifies (a forged one does not count)."""
        for key in keys:
            raw = self._raw(key)
            if raw is None or self._open(key, raw) is None:
                return False
        return True

    def get(self, key: str) -> bytes:
        """The verified value of ``key``, waiting (the store's timeout) while it is absent or fails authentication.

        Raises:
            torch.distributed.DistStoreError: no valid record within the store's timeout.
        """
        value = self._open(key, self.store.get(key))  # an honest wait blocks on the store, as without a secret
        if value is not None:
            return value
        deadline = time.monotonic() + self.timeout.total_seconds()
        while time.monotonic() < deadline:
            time.sleep(_POLL)
            raw = self._raw(key)
            value = None if raw is None else self._open(key, raw)
            if value is not None:
                return value
        raise dist.DistStoreError(f"no record of {self._full(key)!r} on the live job's store that passes "
                                  f"authentication within {self.timeout.total_seconds():.0f} s")

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        """Write ``desired_value`` at ``key`` unless a valid record stands there; the value that stands.

        A record there that fails authentication counts as absent: it is
        replaced (atomically, unless it changes meanwhile; at most
        :data:`REPLACE_ATTEMPTS` times).

        Raises:
            ValueError: ``expected_value`` is not empty (only "create if absent" is signed).
            torch.distributed.DistStoreError: the key kept being overwritten with forged records.
        """
        if _bytes(expected_value):
            raise ValueError(f"expected_value must be '' (write when absent) on a signed store, got "
                             f"{expected_value!r}")
        mine = self._sign(key, desired_value)
        held = self.store.compare_set(key, "", _wire(mine))
        for _ in range(REPLACE_ATTEMPTS):
            value = held if held == mine else self._open(key, held)
            if value is not None:
                return _bytes(desired_value) if held == mine else value
            held = self.store.compare_set(key, _wire(held), _wire(mine))  # the forged one, unless it changed since
        raise dist.DistStoreError(f"cannot write {self._full(key)!r} on the live job's store: it kept being "
                                  "overwritten with records that fail authentication")

    def add(self, key: str, value: int) -> int:
        """Add ``value`` to counter ``key`` (unsigned: see the module docstring)."""
        return int(self.store.add(key, value))

    def delete_key(self, key: str) -> bool:
        return bool(self.store.delete_key(key))

    def num_keys(self) -> int:
        return int(self.store.num_keys())

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        """Wait until every key of ``keys`` holds a valid record (at most ``timeout``, default the store's).

        Raises:
            torch.distributed.DistStoreError: they did not within the timeout.
        """
        seconds = (timeout or self.timeout).total_seconds()
        deadline = time.monotonic() + seconds
        while not self.check(keys):
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"keys {list(keys)} hold no valid records after {seconds:.0f} s")
            time.sleep(_POLL)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.store.set_timeout(timeout)

    @property
    def timeout(self) -> datetime.timedelta:
        """The store's timeout: how long a blocking call waits."""
        return cast(datetime.timedelta, getattr(self.store, "timeout"))


def wrap(store: dist.Store, scope: str = "") -> dist.Store:
    """``store`` whose records are signed and verified with the job's secret (:func:`env.live_secret`); the
    store itself when the job has none.  ``scope``: the prefix ``store`` puts before every key."""
    secret = env.live_secret()
    return store if secret is None else SignedStore(store, secret, scope)


def unsigned(store: dist.Store) -> dist.Store:
    """The store under the signatures (``store`` itself when unsigned): for a blocking wait until a key exists,
    which a signature does not change (the value read after it is verified as always)."""
    return store.store if isinstance(store, SignedStore) else store


def is_signed(store: dist.Store) -> bool:
    """Whether ``store``'s records are signed (the job has a secret)."""
    return isinstance(store, SignedStore)


def read(store: dist.Store, key: str) -> str | None:
    """The value of ``key`` (verified on a signed store), None when absent or forged; never blocks."""
    if isinstance(store, SignedStore):
        return store.read(key)
    if not store.check([key]):
        return None
    return store.get(key).decode()
