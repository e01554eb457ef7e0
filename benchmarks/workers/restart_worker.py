"""Training script for bench_restart.py: records when each start-up phase ends."""
import time

T_START = time.time()
import json  # noqa: E402
import os  # noqa: E402

import torch  # noqa: E402

T_TORCH = time.time()
import adaptive  # noqa: E402

OUT = os.environ["WORKER_OUT"]
rank = int(os.environ.get("RANK", 0))
adaptive.init_process_group("gloo")
T_INIT = time.time()
torch.manual_seed(0)
width = int(os.environ.get("BENCH_WIDTH", "1024"))
model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                            torch.nn.ReLU(), torch.nn.Linear(width, 10))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
model = adaptive.AdaptiveDataParallel(model, optimizer)
data = torch.utils.data.TensorDataset(torch.randn(4096, width), torch.randint(0, 10, (4096,)))
loader = adaptive.AdaptiveDataLoader(data, batch_size=64, shuffle=True)
T_LOAD = time.time()
first = None
for epoch in adaptive.remaining_epochs_until(1000):
    for x, y in loader:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if first is None:
            first = time.time()
            record = {"pid": os.getpid(), "start": T_START, "torch": T_TORCH, "init": T_INIT, "load": T_LOAD,
                      "first_step": first, "resumed": adaptive.checkpoint.states.resumed_checkpoint() is not None}
            with open(os.path.join(OUT, f"timeline.rank{rank}.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")
        with open(os.path.join(OUT, f"steps.rank{rank}"), "w") as f:
            f.write(f"{os.getpid()} {loader.step}")
