"""Local stand-ins for the datasets the original scripts download (MNIST, CIFAR-10, CelebA).

Every sample is generated from its index and a seed only, so every replica,
every DataLoader worker and every restart sees the same data.  Each item
ends with the sample's index, which the corpus scripts record so that the
tests can check that every sample was trained on exactly once per epoch.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class SyntheticImages(Dataset):
    """Noisy copies of one fixed pattern per class: learnable in a few epochs by a small CNN.

    Items are ``(image, label, index)``, images ``channels x size x size``
    roughly normalised like ``transforms.Normalize`` output.
    """

    def __init__(self, length: int, *, channels: int = 1, size: int = 16, classes: int = 10,
                 noise: float = 3.0, seed: int = 0, split: int = 0) -> None:
        patterns = torch.randn(classes, channels, size, size, generator=torch.Generator().manual_seed(seed))
        generator = torch.Generator().manual_seed(seed * 1000 + split + 1)
        self.labels = torch.randint(classes, (length,), generator=generator)
        self.images = patterns[self.labels] + noise * torch.randn(length, channels, size, size, generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.images[index], self.labels[index], index
