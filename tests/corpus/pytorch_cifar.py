"""AdaptDL's examples/pytorch-cifar/main.py ("Train CIFAR10 with PyTorch"), ported to adaptive.

Changes from the original: ``import adaptive as adl`` for ``adaptdl.torch``
and the renames of docs/migration-adaptdl.md (``adl.env.rank()`` for
``adaptdl.env.replica_rank()``, ``to_tensorboard(writer, step)`` without
``tag_prefix``), ``torch.amp`` for ``torch.cuda.amp`` so that
``--mixed-precision`` also runs on a CPU, synthetic CIFAR-sized data
instead of the torchvision download (datasets return each sample's index),
a small ResNet instead of ``models/``, milestones as an argument, the
TensorBoard writer skipped when tensorboard is not installed, and the
``probe`` calls the tests read.  What the example does stays: rank 0
prepares the data and builds its loader before a ``dist.barrier()`` that
the other ranks wait in before building theirs; DataLoader workers; SGD
with momentum over one parameter group per tensor; MultiStepLR; a
GradScaler; accumulators created inside ``train()`` and ``valid()`` every
epoch; a validation loader iterated every epoch; a SummaryWriter.
"""

import argparse
import os

import torch
import torch.backends.cudnn as cudnn
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import MultiStepLR

import adaptive as adl  # was: import adaptdl; import adaptdl.torch as adl
import corpus_probe as probe
from corpus_data import SyntheticImages

try:
    from torch.utils.tensorboard import SummaryWriter
except ImportError:  # tensorboard is optional: train without the event files
    class SummaryWriter:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def add_scalar(self, *args, **kwargs):
            pass


class BasicBlock(nn.Module):
    def __init__(self, planes):
        super().__init__()
        self.conv1 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + x)


class ResNetTiny(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        self.block = BasicBlock(16)
        self.linear = nn.Linear(16, num_classes)

    def forward(self, x):
        out = F.relu(self.bn(self.conv(x)))
        out = F.max_pool2d(self.block(out), 2)
        return self.linear(F.adaptive_avg_pool2d(out, 1).flatten(1))


MODELS = {"ResNetTiny": ResNetTiny}

parser = argparse.ArgumentParser(description='PyTorch CIFAR10 Training')
parser.add_argument('--bs', default=128, type=int, help='batch size')
parser.add_argument('--lr', default=0.1, type=float, help='learning rate')
parser.add_argument('--epochs', default=60, type=int, help='number of epochs')
parser.add_argument('--model', default='ResNetTiny', type=str, help='model')
parser.add_argument('--autoscale-bsz', dest='autoscale_bsz', default=False,
                    action='store_true', help='autoscale batchsize')
parser.add_argument('--mixed-precision', dest='mixed_precision', default=False,
                    action='store_true', help='use automatic mixed precision')
parser.add_argument('--milestones', default='30,45', help='MultiStepLR milestones (epochs)')
parser.add_argument('--train-size', default=2560, type=int, help='synthetic training samples')
parser.add_argument('--valid-size', default=1000, type=int, help='synthetic validation samples')
args = parser.parse_args()

device = 'cuda' if torch.cuda.is_available() else 'cpu'

# Data
print('==> Preparing data..')


def make_dataset(train):
    """What torchvision.datasets.CIFAR10(root=adl.env.share_path(), train=train, ...) gave."""
    size = args.train_size if train else args.valid_size
    return SyntheticImages(size, channels=3, size=16, seed=3, split=0 if train else 1)


adl.init_process_group("nccl" if torch.cuda.is_available() else "gloo")

if adl.env.rank() == 0:
    trainset = make_dataset(train=True)
    trainloader = adl.AdaptiveDataLoader(trainset, batch_size=args.bs, shuffle=True, num_workers=2, drop_last=True)
    dist.barrier()  # We use a barrier here so that non-master replicas would wait for master to download the data
else:
    dist.barrier()
    trainset = make_dataset(train=True)
    trainloader = adl.AdaptiveDataLoader(trainset, batch_size=args.bs, shuffle=True, num_workers=2, drop_last=True)

if args.autoscale_bsz:
    trainloader.autoscale_batch_size(4096, local_bsz_bounds=(32, 1024), gradient_accumulation=False)

validset = make_dataset(train=False)
validloader = adl.AdaptiveDataLoader(validset, batch_size=100, shuffle=False, num_workers=2)

# Model
print('==> Building model..')
net = MODELS[args.model]()
net = net.to(device)
if device == 'cuda':
    cudnn.benchmark = True

criterion = nn.CrossEntropyLoss()
optimizer = optim.SGD([{"params": [param]} for param in net.parameters()],
                      lr=args.lr, momentum=0.9, weight_decay=5e-4)
lr_scheduler = MultiStepLR(optimizer, [int(m) for m in args.milestones.split(",")], 0.1)

if args.mixed_precision:
    scaler = torch.amp.GradScaler(device, enabled=True)
else:
    scaler = None
net = adl.AdaptiveDataParallel(net, optimizer, lr_scheduler, scaler)
probe.started({"model": net})


# Training
def train(epoch):
    print('\nEpoch: %d' % epoch)
    net.train()
    stats = adl.Accumulator()
    for inputs, targets, index in trainloader:
        optimizer.zero_grad()
        if args.mixed_precision:
            inputs, targets = inputs.to(device), targets.to(device)
            with torch.autocast(device_type=device):
                outputs = net(inputs)
                loss = criterion(outputs, targets)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            inputs, targets = inputs.to(device), targets.to(device)
            outputs = net(inputs)
            loss = criterion(outputs, targets)
            loss.backward()
            optimizer.step()

        stats["loss_sum"] += loss.item() * targets.size(0)
        _, predicted = outputs.max(1)
        stats["total"] += targets.size(0)
        stats["correct"] += predicted.eq(targets).sum().item()
        probe.step(epoch, "train", trainloader, index)

    trainloader.to_tensorboard(writer, epoch)
    net.to_tensorboard(writer, epoch)
    if args.mixed_precision:
        writer.add_scalar("MixedPrecision/scale", scaler.get_scale(), epoch)
    with stats.synchronized():
        stats["loss_avg"] = stats["loss_sum"] / stats["total"]
        stats["accuracy"] = stats["correct"] / stats["total"]
        writer.add_scalar("Loss/Train", stats["loss_avg"], epoch)
        writer.add_scalar("Accuracy/Train", stats["accuracy"], epoch)
        probe.totals(epoch, "train", stats)
        print("Train:", stats)


def valid(epoch):
    net.eval()
    stats = adl.Accumulator()
    with torch.no_grad():
        for inputs, targets, index in validloader:
            inputs, targets = inputs.to(device), targets.to(device)
            outputs = net(inputs)
            loss = criterion(outputs, targets)

            stats["loss_sum"] += loss.item() * targets.size(0)
            _, predicted = outputs.max(1)
            stats["total"] += targets.size(0)
            stats["correct"] += predicted.eq(targets).sum().item()
            probe.step(epoch, "valid", validloader, index)

    with stats.synchronized():
        stats["loss_avg"] = stats["loss_sum"] / stats["total"]
        stats["accuracy"] = stats["correct"] / stats["total"]
        writer.add_scalar("Loss/Valid", stats["loss_avg"], epoch)
        writer.add_scalar("Accuracy/Valid", stats["accuracy"], epoch)
        probe.totals(epoch, "valid", stats)
        print("Valid:", stats)


tensorboard_dir = os.path.join(os.getenv("ADAPTIVE_TENSORBOARD_LOGDIR", os.path.join(adl.env.share_path(), "tensorboard"))
                               if adl.env.rank() == 0 else os.path.join(adl.env.share_path(), f"tensorboard-rank{adl.env.rank()}"),
                               adl.env.job_id())
with SummaryWriter(tensorboard_dir) as writer:
    for epoch in adl.remaining_epochs_until(args.epochs):
        train(epoch)
        probe.pause(epoch, "between-loops")
        valid(epoch)
        lr_scheduler.step()
        probe.epoch_end(epoch, lr=lr_scheduler.get_last_lr()[0])
        probe.pause(epoch, "epoch-end")
probe.done({"train": trainloader, "valid": validloader}, {"model": net})
