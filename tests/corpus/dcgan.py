"""AdaptDL's examples/dcgan/dcgan.py (the PyTorch DCGAN tutorial, modified for AdaptDL), ported to adaptive.

Changes from the original: ``import adaptive as adl`` for ``adaptdl.torch``
and the renames of docs/migration-adaptdl.md; the wrappers' names are given
as ``name=`` (``AdaptiveDataParallel``'s fourth positional argument is the
grad scaler here); the gradient statistics that AdaptDL read from
``adaptdl.torch._metrics._metrics_state().grad_params`` are read from the
wrapper's ``gns``; ``adaptdl.get_tensorboard_dir()`` is the share path's
``tensorboard`` folder; synthetic 16x16 "faces" instead of the CelebA
download, so the networks are scaled down to 16x16 pictures; float labels
(``BCELoss`` needs them on current torch); ``--epochs``; the TensorBoard
writer skipped when tensorboard is not installed; an ``n`` and a
``batches`` count next to the example's totals, and the ``probe`` calls
the tests read.  The tutorial's long commentary is left out.

What the example does stays: two models with their own optimizers and
schedulers, DataLoader workers, autoscale, a random seed per process, an
accumulator created inside ``train()`` every epoch, and the variable
``b_size`` set inside the loop and used after it.
"""

from __future__ import print_function

import argparse
import os
import random

import torch
import torch.nn as nn
import torch.nn.parallel
import torch.optim as optim
import torch.utils.data

import adaptive as adl  # was: import adaptdl; import adaptdl.torch as adl
import corpus_probe as probe
from corpus_data import SyntheticImages

try:
    from torch.utils.tensorboard import SummaryWriter
except ImportError:  # tensorboard is optional: train without the event files
    SummaryWriter = None

parser = argparse.ArgumentParser(description="DCGAN")
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--size", type=int, default=2560, help="synthetic pictures")
args = parser.parse_args()

# Set random seed for reproducibility
# manualSeed = 9999
manualSeed = random.randint(1, 10000)  # use if you want new results
print("Random Seed: ", manualSeed)
random.seed(manualSeed)
torch.manual_seed(manualSeed)

# Number of workers for dataloader
workers = 2

# Batch size during training
batch_size = 128

# Spatial size of training images.
image_size = 16

# Number of channels in the training images. For color images this is 3
nc = 3

# Size of z latent vector (i.e. size of generator input)
nz = 16

# Size of feature maps in generator
ngf = 8

# Size of feature maps in discriminator
ndf = 8

# Number of training epochs
num_epochs = args.epochs

# Learning rate for optimizers
lr = 0.0005

# Number of GPUs available. Use 0 for CPU mode.
ngpu = 1

# Root directory for dataset
dataroot = adl.env.share_path()

dataset = SyntheticImages(args.size, channels=nc, size=image_size, noise=0.5, seed=5)  # was: dsets.CelebA(dataroot, ...)

dataloader = adl.AdaptiveDataLoader(dataset, batch_size=batch_size,
                                    num_workers=workers, shuffle=False)
dataloader.autoscale_batch_size(8 * batch_size, local_bsz_bounds=(8, 1024))

device = torch.device("cuda:0" if (torch.cuda.is_available() and ngpu > 0) else "cpu")


def weights_init(m):
    classname = m.__class__.__name__
    if classname.find('Conv') != -1:
        nn.init.normal_(m.weight.data, 0.0, 0.02)
    elif classname.find('BatchNorm') != -1:
        nn.init.normal_(m.weight.data, 1.0, 0.02)
        nn.init.constant_(m.bias.data, 0)


class Generator(nn.Module):
    def __init__(self, ngpu):
        super(Generator, self).__init__()
        self.ngpu = ngpu
        self.main = nn.Sequential(
            # input is Z, going into a convolution
            nn.ConvTranspose2d(nz, ngf * 4, 4, 1, 0, bias=False),
            nn.BatchNorm2d(ngf * 4),
            nn.ReLU(True),
            # state size. (ngf*4) x 4 x 4
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            # state size. (ngf*2) x 8 x 8
            nn.ConvTranspose2d(ngf * 2, nc, 4, 2, 1, bias=False),
            nn.Tanh()
            # state size. (nc) x 16 x 16
        )

    def forward(self, input):
        return self.main(input)


netG = Generator(ngpu).to(device)
netG.apply(weights_init)


class Discriminator(nn.Module):
    def __init__(self, ngpu):
        super(Discriminator, self).__init__()
        self.ngpu = ngpu
        self.main = nn.Sequential(
            # input is (nc) x 16 x 16
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False),
            nn.LeakyReLU(0.2, inplace=True),
            # state size. (ndf) x 8 x 8
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            # state size. (ndf*2) x 4 x 4
            nn.Conv2d(ndf * 2, 1, 4, 1, 0, bias=False),
            nn.Sigmoid()
        )

    def forward(self, input):
        return self.main(input)


netD = Discriminator(ngpu).to(device)
netD.apply(weights_init)

# Initialize BCELoss function
criterion = nn.BCELoss()

# Establish convention for real and fake labels during training
real_label = 1.
fake_label = 0.

optimizerD = optim.SGD(netD.parameters(), lr=lr, momentum=0.9, nesterov=True)
optimizerG = optim.SGD(netG.parameters(), lr=lr, momentum=0.9, nesterov=True)
scheduleD = optim.lr_scheduler.StepLR(optimizerD, 15, 0.1)
scheduleG = optim.lr_scheduler.StepLR(optimizerG, 15, 0.1)

adl.init_process_group("nccl" if torch.cuda.is_available()
                       else "gloo")
netD = adl.AdaptiveDataParallel(netD, optimizerD, scheduleD, name="netD")
netG = adl.AdaptiveDataParallel(netG, optimizerG, scheduleG, name="netG")
probe.started({"netD": netD, "netG": netG})

# Lists to keep track of progress
img_list = []
G_losses = []
D_losses = []


def train(epoch):
    iters = 0
    # For each batch in the dataloader
    stats = adl.Accumulator()
    for i, data in enumerate(dataloader, 0):
        index = data[2]
        data = data[0]
        ############################
        # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
        ###########################
        ## Train with all-real batch
        netD.zero_grad()
        # Format batch
        real_cpu = data.to(device)
        b_size = real_cpu.size(0)
        label = torch.full((b_size,), real_label, device=device)
        # Forward pass real batch through D
        output = netD(real_cpu).view(-1)
        # Calculate loss on all-real batch
        errD_real = criterion(output, label)
        # Calculate gradients for D in backward pass
        errD_real.backward()
        D_x = output.mean().item()

        ## Train with all-fake batch
        # Generate batch of latent vectors
        noise = torch.randn(b_size, nz, 1, 1, device=device)
        # Generate fake image batch with G
        fake = netG(noise)
        label.fill_(fake_label)
        # Classify all fake batch with D
        output = netD(fake.detach()).view(-1)
        # Calculate D's loss on the all-fake batch
        errD_fake = criterion(output, label)
        # Calculate the gradients for this batch
        errD_fake.backward()
        D_G_z1 = output.mean().item()
        # Add the gradients from the all-real and all-fake batches
        errD = errD_real + errD_fake
        # Update D
        optimizerD.step()

        ############################
        # (2) Update G network: maximize log(D(G(z)))
        ###########################
        netG.zero_grad()
        label.fill_(real_label)  # fake labels are real for generator cost
        # Since we just updated D, perform another forward pass of all-fake batch through D
        output = netD(fake).view(-1)
        # Calculate G's loss based on this output
        errG = criterion(output, label)
        # Calculate gradients for G
        errG.backward()
        D_G_z2 = output.mean().item()
        # Update G
        optimizerG.step()

        # Save Losses for plotting later
        G_losses.append(errG.item())
        D_losses.append(errD.item())

        stats["g_loss_sum"] += errG.item()
        stats["d_loss_sum"] += errD.item()
        stats["n"] += b_size
        stats["batches"] += 1
        probe.step(epoch, "train", dataloader, index)
    stats["norm"] += netD.gns.sqr_avg()  # was: metrics._metrics_state().grad_params[0]
    stats["var"] += netD.gns.var_avg()  # was: metrics._metrics_state().grad_params[1]
    stats["replicas"] += 1.0
    scheduleD.step()
    scheduleG.step()

    with stats.synchronized():
        probe.totals(epoch, "train", stats)
        tensorboard_dir = os.path.join(adl.env.share_path(), "tensorboard")  # was: adaptdl.get_tensorboard_dir()
        if SummaryWriter is not None:
            with SummaryWriter(tensorboard_dir) as writer:
                writer.add_scalar("Loss/G", stats["g_loss_sum"] / stats["replicas"], epoch)
                writer.add_scalar("Loss/D", stats["d_loss_sum"] / stats["replicas"], epoch)
                writer.add_scalar("Performance/GlobalBatchsize", b_size * stats["replicas"], epoch)
                writer.add_scalar("Performance/Replicas", stats["replicas"], epoch)
                writer.add_scalar("Stats/Variance", stats["norm"] / stats["replicas"], epoch)
                writer.add_scalar("Stats/Norm", stats["var"] / stats["replicas"], epoch)
        else:
            print("epoch", epoch, "global batch", b_size * stats["replicas"])


for epoch in adl.remaining_epochs_until(num_epochs):
    train(epoch)
    probe.epoch_end(epoch, lr=scheduleD.get_last_lr()[0])
    probe.pause(epoch, "epoch-end")
probe.done({"train": dataloader}, {"netD": netD, "netG": netG})
