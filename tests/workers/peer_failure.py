"""Two replicas; rank 1 misbehaves (``hang`` or ``die``) and rank 0 reports what it sees.

Rank 0 writes ``result.json``: the exception type and message of its failed
collective, and how many seconds it waited.
"""

import json
import os
import sys
import time

import adaptive
from adaptive.runtime import collectives

mode, out = sys.argv[1], sys.argv[2]
adaptive.init_process_group("gloo")
collectives.barrier()
if int(os.environ["RANK"]) == 1:
    if mode == "die":
        os._exit(9)
    time.sleep(120)  # hang: never joins the next collective
    sys.exit(0)
start = time.monotonic()
try:
    collectives.allreduce_object(1)
    outcome = {"error": None}
except collectives.CollectiveError as error:
    outcome = {"error": type(error).__name__, "message": str(error)}
outcome["seconds"] = time.monotonic() - start
with open(os.path.join(out, "result.json"), "w") as f:
    json.dump(outcome, f)
os._exit(0)
