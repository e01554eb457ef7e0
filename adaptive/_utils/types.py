"""The library's names for its two open-ended data shapes (not public API).

:data:`StateDict` is what ``state_dict()`` returns and ``load_state_dict()``
takes, as :data:`torch.distributed.checkpoint.state_dict_saver.STATE_DICT_TYPE`
names it for DCP. :data:`JSON` is one JSON object: a line of ``metrics.jsonl``,
a launch-status record, a checkpoint manifest's body. Both are dicts with string
keys and untyped values because those values are open by design (a state dict nests tensors, numbers,
strings, lists and dicts as each owner chooses; a record's fields depend on its
kind); every annotation that means one of them uses the name, so a reader sees
which concept a ``dict`` is and the type is written in one place.
"""

from __future__ import annotations

from typing import Any

__all__ = ["StateDict", "JSON"]

#: A nested state dict: string keys, values tensors, numbers, strings, None and lists,
#: tuples or dicts of them, as ``state_dict()`` returns it and ``load_state_dict()`` takes
#: it; also its flattened form (``{key path: leaf}``) that the checkpoint's sharded part
#: writes (torch.distributed.checkpoint's ``STATE_DICT_TYPE``).
StateDict = dict[str, Any]

#: One JSON object, as :func:`json.loads` decodes it or :func:`json.dumps` will encode it:
#: a metrics record, a launch-status record, a checkpoint manifest's body.
JSON = dict[str, Any]
