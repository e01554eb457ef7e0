"""PyTorch's torchrun fault-tolerance tutorial (pytorch/examples,
``distributed/ddp-tutorial-series/multigpu_torchrun.py``), ported to adaptive.

Changes from the original, only those the docs ask for
(docs/quickstart.md, "Adapting your script"): ``adaptive.init_process_group``
for torch's, ``AdaptiveDataParallel`` for DDP, ``AdaptiveDataLoader`` (global
batch) for ``DataLoader`` + ``DistributedSampler`` (so no ``set_epoch``),
``remaining_epochs_until`` for the ``range`` over epochs; the dataset also
returns each sample's index, its random data is drawn with a fixed seed (the
original draws it unseeded, another dataset on every replica and restart),
a dropout layer is added before the head so that replays must draw the
same masks, and SGD has momentum (state for the resume checks); the ``probe`` calls the tests read. What the tutorial does stays:
the ``b_sz = len(next(iter(self.train_data))[0])`` peek at the start of every
epoch, and its own snapshot, ``snapshot.pt``, saved by rank 0 every
``save_every`` epochs and loaded whenever it exists (the library's checkpoint
is restored over it when the wrapper is built).
"""

import argparse
import os

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

import adaptive
import corpus_probe as probe


class MyTrainDataset(Dataset):
    def __init__(self, size):
        self.size = size
        generator = torch.Generator().manual_seed(0)  # added: the same data everywhere
        self.data = [(torch.rand(20, generator=generator), torch.rand(1, generator=generator)) for _ in range(size)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.data[index] + (index,)  # added: the index, for the tests


def ddp_setup():
    adaptive.init_process_group(backend="gloo")  # was: torch.cuda.set_device(...); init_process_group("nccl")


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path):
        self.gpu_id = int(os.environ.get("LOCAL_RANK", 0))
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        if os.path.exists(snapshot_path):
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)
        self.model = adaptive.AdaptiveDataParallel(self.model, optimizer)  # was: DDP(self.model, device_ids=...)
        probe.started({"model": self.model})

    def _load_snapshot(self, snapshot_path):
        snapshot = torch.load(snapshot_path, map_location="cpu")
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)  # was: F.cross_entropy on one output column
        loss.backward()
        self.optimizer.step()
        return loss

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[GPU{self.gpu_id}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)}")
        stats = adaptive.Accumulator()
        for source, targets, index in self.train_data:
            loss = self._run_batch(source, targets)
            stats["n"] += len(index)
            stats["loss_sum"] += loss.item() * len(index)
            probe.step(epoch, "train", self.train_data, index, loss=loss.item())
        with stats.synchronized():
            probe.totals(epoch, "train", stats)

    def _save_snapshot(self, epoch):
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs: int):
        for epoch in adaptive.remaining_epochs_until(max_epochs):  # was: range(self.epochs_run, max_epochs)
            self._run_epoch(epoch)
            if self.gpu_id == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)
            probe.epoch_end(epoch, lr=self.optimizer.param_groups[0]["lr"])
            probe.pause(epoch, "epoch-end")


def load_train_objs(size):
    train_set = MyTrainDataset(size)  # load your dataset
    torch.manual_seed(0)  # added: the same initial model on every replica
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(32, 1))  # was: torch.nn.Linear(20, 1); dropout added
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)  # was: lr=1e-3, no momentum
    return train_set, model, optimizer


def prepare_dataloader(dataset, batch_size):
    # was: DataLoader(dataset, batch_size=batch_size, pin_memory=True, shuffle=False,
    #                 sampler=DistributedSampler(dataset)); batch_size is now the global batch
    return adaptive.AdaptiveDataLoader(dataset, batch_size=batch_size, shuffle=False, drop_last=True)


def main(save_every, total_epochs, batch_size, size, snapshot_path="snapshot.pt"):
    ddp_setup()
    dataset, model, optimizer = load_train_objs(size)
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path)
    trainer.train(total_epochs)
    probe.done({"train": train_data}, {"model": trainer.model})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int, help="Input batch size on each device (default: 32)")
    parser.add_argument("--size", default=2048, type=int, help="samples (added)")
    args = parser.parse_args()
    main(args.save_every, args.total_epochs, args.batch_size, args.size)
