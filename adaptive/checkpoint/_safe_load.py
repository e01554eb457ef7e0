"""What a checkpoint state may contain, and loading it without running code (guarantee G4).

States are read back with ``torch.load(weights_only=True)``, which refuses
every Python global outside PyTorch's allow-list. :func:`validate_states`
checks before anything is written that a state holds only values such a
load accepts, so the store never writes a checkpoint it cannot read;
:func:`deserialise` is that load, with errors that say what was refused.
:func:`validate_metadata` checks the JSON metadata kept in the manifest.
"""

from __future__ import annotations

import collections
import io
import json
import pickle
import re
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import torch

from adaptive._utils.types import JSON

# bytes are deliberately absent: torch pickles b"" through a global that
# weights-only loading refuses. Store binary blobs as uint8 tensors instead.
# What ``torch.load(weights_only=True)`` reads back (its allow-list of globals plus the
# types pickle handles natively), and no more: tensors, plain scalars, and the
# containers torch's own state dicts use (``MultiStepLR`` keeps a Counter).
_SCALAR_TYPES = (type(None), bool, int, float, complex, str, bytes, bytearray,
                 torch.dtype, torch.device, torch.Size, torch.layout)
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_CONTAINER_TYPES = (list, tuple, set, dict, collections.OrderedDict, collections.Counter)


class NotLoadable(Exception):
    """A state file's content was refused or could not be deserialised (the message says which)."""


def validate_states(states: Mapping[str, object]) -> list[tuple[str, object]]:
    """Check ``states`` maps str names to weights-only-loadable values; return its items."""
    if not isinstance(states, Mapping):
        raise TypeError(
            f"states must be a mapping of name -> state dict, got {type(states).__name__}"
        )
    items = list(states.items())
    for name, value in items:
        if not isinstance(name, str):
            raise TypeError(f"state names must be str, got {name!r} ({type(name).__name__})")
        validate_value(value, f"states[{name!r}]")
    return items


def validate_value(value: object, where: str) -> None:
    """Walk ``value`` and raise TypeError at the first unsupported object.

    The allowed set is a subset of what ``torch.load(weights_only=True)``
    accepts, so a state that passes loads back safely. Python attributes
    set on tensors and OrderedDicts are pickled too, so they are walked
    as well (``Module.state_dict()`` sets ``_metadata`` on its result).
    """
    stack = [(value, where)]
    seen: set[int] = set()
    while stack:
        obj, path = stack.pop()
        kind = type(obj)
        if kind in _SCALAR_TYPES:
            continue
        if kind in _TENSOR_TYPES:
            stack.extend((item, f"{path}.{attr}") for attr, item in vars(obj).items())
            continue
        if kind not in _CONTAINER_TYPES:
            raise TypeError(
                f"{path} is a {kind.__module__}.{kind.__qualname__}, which cannot be loaded "
                "safely; checkpoint states may contain only tensors, None, bool, int, float, "
                "complex, str, bytes, torch.dtype/device/Size and list/tuple/set/dict/"
                "OrderedDict/Counter of those "
                "(convert numpy values with torch.from_numpy() or .item())"
            )
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, collections.OrderedDict):
            stack.extend((item, f"{path}.{attr}") for attr, item in vars(obj).items())
        if isinstance(obj, dict):
            for key, item in obj.items():
                stack.append((key, f"{path} key {key!r}"))
                stack.append((item, f"{path}[{key!r}]"))
        elif isinstance(obj, (list, tuple, set)):  # the other containers
            stack.extend((item, f"{path}[{index}]") for index, item in enumerate(obj))


def validate_metadata(metadata: Mapping[str, object] | None) -> JSON:
    """Return a JSON round-tripped copy of ``metadata`` (or {}).

    Raises:
        TypeError: not a mapping with str keys, or not JSON-serialisable
            without NaN/inf.
    """
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise TypeError(
            f"metadata must be a mapping with str keys or None, got {type(metadata).__name__}"
        )
    bad = [key for key in metadata if not isinstance(key, str)]
    if bad:
        raise TypeError(f"metadata keys must be str, got {bad[0]!r}")
    try:
        return json.loads(json.dumps(dict(metadata), allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"metadata must be JSON-serialisable without NaN/inf: {exc}") from exc


def deserialise(data: bytes, name: str, path: Path) -> Any:
    """``torch.load`` with the weights-only unpickler, tensors on the CPU.

    Raises:
        NotLoadable: the data needs an object outside the safe set, or is
            not a torch file; the message says which.
    """
    return load_item(io.BytesIO(data), f"state {name!r} from {path}")


def load_item(stream: IO[bytes], what: str) -> Any:
    """Weights-only ``torch.load`` of one serialised object (a state, a DCP item); ``what`` names it in errors."""
    try:
        return torch.load(stream, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        raise NotLoadable(
            f"refusing to load {what}: {_refusal_detail(str(exc))}. "
            "Only tensors, numbers, strings and containers of them load safely; anything "
            "else could run code from the file. Was it written by this library?"
        ) from None
    except Exception as exc:
        raise NotLoadable(f"cannot deserialise {what}: {exc}") from None


def _refusal_detail(message: str) -> str:
    """The useful part of torch's weights-only refusal, without its advice
    to disable the safety check."""
    found = re.search(r"GLOBAL ([\w.]+)", message)
    if found:
        return f"it needs the Python object {found.group(1)}, which is not allowed"
    found = re.search(r"WeightsUnpickler error:\s*(.+)", message)
    reason = found.group(1).strip() if found else "unknown"
    return f"its pickle data is not accepted by the safe unpickler ({reason})"
