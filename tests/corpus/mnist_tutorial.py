"""AdaptDL's tutorial, step 5 (docs/tutorial/mnist_step_5.py), ported to adaptive.

Changes from the original: ``import adaptive as adl`` for ``adaptdl.torch``
(docs/migration-adaptdl.md), synthetic MNIST-sized data instead of the
download (a smaller picture and CNN so that an epoch takes a second on a
CPU), the datasets also return each sample's index, an ``n`` count next to
the tutorial's test totals, and the ``probe`` calls that record what the
tests check.  What the tutorial does stays: loaders, autoscale, model,
optimizer and scheduler are all built *before* ``init_process_group``; the
test accumulator is created inside ``test()``, every epoch; Adadelta with
StepLR stepped once per epoch.
"""

from __future__ import print_function

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR

import adaptive as adl  # was: import adaptdl; import adaptdl.torch
import corpus_probe as probe
from corpus_data import SyntheticImages


class Net(nn.Module):
    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, 1)
        self.conv2 = nn.Conv2d(16, 32, 3, 1)
        self.dropout1 = nn.Dropout2d(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(32 * 6 * 6, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.relu(x)
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        output = F.log_softmax(x, dim=1)
        return output


def train(args, model, device, train_loader, optimizer, epoch):
    model.train()
    for batch_idx, (data, target, index) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        probe.step(epoch, "train", train_loader, index)
        if batch_idx % args.log_interval == 0:
            print('Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}'.format(
                epoch, batch_idx * len(data), len(train_loader.dataset),
                100. * batch_idx / len(train_loader), loss.item()))
            if args.dry_run:
                break


def test(model, device, test_loader):
    model.eval()
    stats = adl.Accumulator()
    with torch.no_grad():
        for data, target, index in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            stats["test_loss"] += F.nll_loss(output, target, reduction='sum').item()  # sum up batch loss
            pred = output.argmax(dim=1, keepdim=True)  # get the index of the max log-probability
            stats["correct"] += pred.eq(target.view_as(pred)).sum().item()
            stats["n"] += len(target)
            probe.step(adl.current_epoch(), "valid", test_loader, index)

    with stats.synchronized():
        test_loss = stats["test_loss"] / len(test_loader.dataset)
        correct = stats["correct"]
        probe.totals(adl.current_epoch(), "test", stats)

        print('\nTest set: Average loss: {:.4f}, Accuracy: {}/{} ({:.0f}%)\n'.format(
            test_loss, correct, len(test_loader.dataset),
            100. * correct / len(test_loader.dataset)))


def main():
    # Training settings
    parser = argparse.ArgumentParser(description='PyTorch MNIST Example')
    parser.add_argument('--batch-size', type=int, default=64, metavar='N',
                        help='input batch size for training (default: 64)')
    parser.add_argument('--test-batch-size', type=int, default=1000, metavar='N',
                        help='input batch size for testing (default: 1000)')
    parser.add_argument('--epochs', type=int, default=14, metavar='N',
                        help='number of epochs to train (default: 14)')
    parser.add_argument('--lr', type=float, default=1.0, metavar='LR',
                        help='learning rate (default: 1.0)')
    parser.add_argument('--gamma', type=float, default=0.7, metavar='M',
                        help='Learning rate step gamma (default: 0.7)')
    parser.add_argument('--no-cuda', action='store_true', default=False,
                        help='disables CUDA training')
    parser.add_argument('--dry-run', action='store_true', default=False,
                        help='quickly check a single pass')
    parser.add_argument('--seed', type=int, default=1, metavar='S',
                        help='random seed (default: 1)')
    parser.add_argument('--log-interval', type=int, default=10, metavar='N',
                        help='how many batches to wait before logging training status')
    parser.add_argument('--save-model', action='store_true', default=False,
                        help='For Saving the current Model')
    parser.add_argument('--train-size', type=int, default=2560, help='synthetic training samples')
    parser.add_argument('--test-size', type=int, default=640, help='synthetic test samples')
    parser.add_argument('--no-autoscale', action='store_true', default=False,
                        help='skip the tutorial\'s optional step 3 (autoscale_batch_size)')
    args = parser.parse_args()
    use_cuda = not args.no_cuda and torch.cuda.is_available()

    torch.manual_seed(args.seed)

    device = torch.device("cuda" if use_cuda else "cpu")

    kwargs = {'batch_size': args.batch_size}
    if use_cuda:
        kwargs.update({'num_workers': 1,
                       'pin_memory': True,
                       'shuffle': True},
                      )

    dataset1 = SyntheticImages(args.train_size, seed=args.seed, split=0)  # was: datasets.MNIST(train=True)
    dataset2 = SyntheticImages(args.test_size, seed=args.seed, split=1)   # was: datasets.MNIST(train=False)
    train_loader = adl.AdaptiveDataLoader(dataset1, drop_last=True, **kwargs)
    test_loader = adl.AdaptiveDataLoader(dataset2, **kwargs)

    if not args.no_autoscale:
        train_loader.autoscale_batch_size(1028, local_bsz_bounds=(32, 128))

    model = Net().to(device)
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)

    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    adl.init_process_group("nccl" if torch.cuda.is_available()
                           else "gloo")
    model = adl.AdaptiveDataParallel(model, optimizer, scheduler)
    probe.started({"model": model})

    for epoch in adl.remaining_epochs_until(args.epochs):
        train(args, model, device, train_loader, optimizer, epoch)
        test(model, device, test_loader)
        scheduler.step()
        probe.epoch_end(epoch, lr=scheduler.get_last_lr()[0])
        probe.pause(epoch, "epoch-end")

    probe.done({"train": train_loader, "test": test_loader}, {"model": model})
    if args.save_model:
        torch.save(model.state_dict(), "mnist_cnn.pt")


if __name__ == '__main__':
    main()
