"""AdaptDL's examples/linear_regression/main.py, ported to adaptive.

Changes from the original: ``import adaptive as adl`` for ``adaptdl.torch``
(docs/migration-adaptdl.md); a fixed seed before the data is drawn (the
original draws the target polynomial unseeded, so every replica and every
restart fitted another one); the dataset also returns each sample's index;
the ``probe`` calls the tests read.  What the example does stays:
``init_process_group`` at import time, a trainer object, DataLoader
workers, SGD with momentum, a MultiStepLR it never steps, a print per
step (and ``--autoscale-bsz``, which the original parses and never uses).
"""

from __future__ import print_function

import argparse

import torch
import torch.backends.cudnn as cudnn
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import MultiStepLR
from torch.utils.data import Dataset

import adaptive as adl  # was: import adaptdl; import adaptdl.torch as adl
import corpus_probe as probe

adl.init_process_group("nccl" if torch.cuda.is_available()
                       else "gloo")

torch.manual_seed(0)  # added: the same data on every replica and after every restart
POLY_DEGREE = 4
W_target = torch.randn(POLY_DEGREE, 1) * 5
b_target = torch.randn(1) * 5


parser = argparse.ArgumentParser(description='Linear Regression Training')
parser.add_argument('--bs', default=128, type=int, help='batch size')
parser.add_argument('--lr', default=0.1, type=float, help='learning rate')
parser.add_argument('--epochs', default=90, type=int, help='number of epochs')
parser.add_argument('--autoscale-bsz', dest='autoscale_bsz', default=False, action='store_true',
                    help='autoscale batchsize')
parser.add_argument('--size', default=10000, type=int, help='samples')
args = parser.parse_args()


device = 'cuda' if torch.cuda.is_available() else 'cpu'


class Trainer(object):
    def __init__(self, model, optim, lr_scheduler):
        self.model = model
        model.train()
        self.optim = optim
        self.lr_scheduler = lr_scheduler

        self.criterion = nn.CrossEntropyLoss()

    # Training
    def train(self, inputs, targets):
        inputs, targets = inputs.to(device), targets.to(device)
        self.optim.zero_grad()
        outputs = self.model(inputs)
        loss = F.smooth_l1_loss(outputs, targets)
        loss.backward()
        self.optim.step()
        return {"Loss": loss.item()}


# Define model
fc = torch.nn.Linear(W_target.size(0), 1)

net = fc.to(device)
if device == 'cuda':
    cudnn.benchmark = True

if args.autoscale_bsz:
    max_batch_size = 8 * args.bs
    local_bsz_bounds = (32, 1024)
else:
    max_batch_size = None
    local_bsz_bounds = None


def make_features(x):
    """Builds features i.e. a matrix with columns [x, x^2, x^3, x^4]."""
    x = x.unsqueeze(1)
    return torch.cat([x ** i for i in range(1, POLY_DEGREE + 1)], 1)


def f(x):
    """Approximated function."""
    return x.mm(W_target) + b_target.item()


class SimpleDataset(Dataset):
    def __init__(self, size):
        random = torch.randn(size)
        x = make_features(random)
        y = f(x) + 0.25 * torch.randn(1)
        self.data = list(zip(x, y))

    def __getitem__(self, index):
        return self.data[index] + (index,)

    def __len__(self):
        return len(self.data)


dataset = SimpleDataset(args.size)
dataloader = adl.AdaptiveDataLoader(dataset, batch_size=args.bs, shuffle=True, num_workers=2, drop_last=True)

optimizer = optim.SGD(net.parameters(), lr=args.lr, momentum=0.9,
                      weight_decay=5e-4)
lr_scheduler = MultiStepLR(optimizer, [30, 45], 0.1)

net = adl.AdaptiveDataParallel(net, optimizer, lr_scheduler)
probe.started({"model": net})
trainer = Trainer(net, optimizer, lr_scheduler)

for epoch in adl.remaining_epochs_until(args.epochs):

    for inputs, targets, index in dataloader:
        batch_stat = trainer.train(inputs, targets)
        probe.step(epoch, "train", dataloader, index)
        print(batch_stat)
    probe.epoch_end(epoch, lr=lr_scheduler.get_last_lr()[0])
    probe.pause(epoch, "epoch-end")
probe.done({"train": dataloader}, {"model": net})
