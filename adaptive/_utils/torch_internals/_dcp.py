"""Distributed checkpoint (DCP): the private names its ``.metadata`` pickle refers to.

Reading a checkpoint unpickles DCP's ``.metadata`` with an allow-list and
checks where each item lies in a file.  Part of the adapter
:mod:`adaptive._utils.torch_internals` (import the names from there).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.checkpoint.filesystem import _StorageInfo as DcpStorageInfo

__all__ = ["dcp_storage_info_class", "dcp_metadata_private_globals"]


def dcp_storage_info_class() -> type[DcpStorageInfo]:
    """DCP's ``_StorageInfo`` (``torch.distributed.checkpoint.filesystem``): where an item lies in a file.

    Why: ``FileSystemWriter``'s ``.metadata`` records each item's file and
    range as one; reading a checkpoint safely checks them, and DCP has no
    public name for it.  In torch 2.x; checked on 2.13.
    """
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo


def dcp_metadata_private_globals() -> dict[tuple[str, str], object]:
    """The private objects a DCP ``.metadata`` pickle names, ``{(module, name): object}``.

    Why: the library unpickles ``.metadata`` with an allow-list (no code
    from the files runs), and DCP's pickle refers to these private names
    (its ``_StorageInfo`` records, the memory-format enum of its tensor
    properties, torch's layout helper).  Checked on 2.13.
    """
    names = (("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
             ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
             ("torch.serialization", "_get_layout"))
    return {(module, name): getattr(importlib.import_module(module), name) for module, name in names}
