"""The API in thirty lines: elastic linear regression on generated data.

    python examples/linear_regression.py                               # one replica
    adaptive-run --standalone --nproc-per-node=2 examples/linear_regression.py
"""
import logging

import torch

import adaptive

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
torch.manual_seed(0)  # the data and the initial weights are the same on every replica and every restart
true_w = torch.randn(16, 1)
features = torch.randn(20_000, 16)
dataset = torch.utils.data.TensorDataset(features, features @ true_w + 0.1 * torch.randn(20_000, 1))

adaptive.init_process_group("gloo")
model = torch.nn.Linear(16, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
model = adaptive.AdaptiveDataParallel(model, optimizer)
loader = adaptive.AdaptiveDataLoader(dataset, batch_size=128, shuffle=True)
stats = adaptive.Accumulator()

for epoch in adaptive.remaining_epochs_until(12):
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        stats["loss_sum"] += loss.item() * len(x)
        stats["n"] += len(x)
    with stats.synchronized():
        if adaptive.env.rank() == 0:
            logging.info("epoch %d: loss %.4f (%d replicas)", epoch, stats["loss_sum"] / stats["n"],
                         adaptive.env.num_replicas())
        stats.clear()
