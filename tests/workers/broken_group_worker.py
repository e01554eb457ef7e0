"""A member of a three-process gloo group whose collective can never complete, for ``test_broken_groups.py``.

Usage: ``broken_group_worker.py RANK PORT OUT KEEP``.  The three processes
all-reduce once; then rank 2 sends nothing more but stays alive (as a member
that saw a loss first and gave up the step), while ranks 0 and 1 start an
all-reduce that waits for it until the collective timeout (60 s).  Ranks 0
and 1 then leave the group as a member that re-forms does: with ``KEEP=1``
through :func:`adaptive.runtime.broken_groups.keep`, otherwise by dropping
it.  Each appends to ``OUT`` how long dropping the group took, then exits.
"""
import datetime
import gc
import json
import sys
import time

import torch
import torch.distributed as dist

from adaptive.runtime import broken_groups

rank, port, out, keep = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
store = dist.TCPStore("127.0.0.1", port, 3, rank == 0, timeout=datetime.timedelta(seconds=30))
dist.init_process_group("gloo", store=store, rank=rank, world_size=3, timeout=datetime.timedelta(seconds=60))
dist.all_reduce(torch.ones(4))
store.add("ready", 1)
if rank == 2:
    time.sleep(90)  # alive, silent; the test ends it
    sys.exit(0)
work = dist.all_reduce(torch.ones(4), async_op=True)  # waits for rank 2 until the timeout
while int(store.add("ready", 0)) < 3:
    time.sleep(0.05)
time.sleep(0.5)
started = time.monotonic()
if keep:
    broken_groups.keep(dist.group.WORLD, work, timeout=60.0)
dist.destroy_process_group()
del work
gc.collect()
with open(out, "a") as handle:
    handle.write(json.dumps({"rank": rank, "dropped_in": time.monotonic() - started, "held": broken_groups.held()})
                 + "\n")
    handle.flush()
sys.exit(0)
