"""The peer pipeline we measure against: torch DataLoader + torchvision-style transforms.

torchvision's ``ImageFolder`` + ``RandomResizedCrop`` + ``RandomHorizontalFlip``
+ ``PILToTensor`` are Pillow calls; this module makes the same Pillow calls
(torchvision itself does not install beside the CPU torch wheel used here), so
the comparison is Pillow-per-sample in DataLoader workers against our fused
kernel in ring workers, on the same files.
"""
from __future__ import annotations

import math
import random

import numpy as np


def rrc_params(rng, height, width, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """torchvision ``RandomResizedCrop.get_params``: (top, left, h, w)."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


class PillowImageFolder:
    """torchvision-style dataset over an :class:`echo_native.ImageFolder` listing."""

    def __init__(self, folder, size=224, draft=False, seed=0):
        self.paths = [folder.path(i) for i in range(len(folder))]
        self.labels = np.asarray(folder.labels)
        self.size, self.draft, self.seed = int(size), draft, seed

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        import torch
        from PIL import Image

        rng = random.Random(self.seed * 1_000_003 + i)
        with Image.open(self.paths[i]) as im:
            top, left, h, w = rrc_params(rng, im.height, im.width)
            box = (left, top, left + w, top + h)
            if self.draft and im.format == "JPEG":
                full = im.size
                im.draft("RGB", (max(1, w * self.size // max(w, 1)), self.size))
                sx, sy = im.size[0] / full[0], im.size[1] / full[1]
                box = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
            im = im.convert("RGB").resize((self.size, self.size), Image.BILINEAR, box=box)
        if rng.random() < 0.5:
            im = im.transpose(Image.FLIP_LEFT_RIGHT)
        # PILToTensor copies the pixels into a tensor: so do we.
        return torch.from_numpy(np.array(im)).permute(2, 0, 1), int(self.labels[i])


def torch_loader(folder, batch_size, workers, size=224, seed=0):
    """A torch DataLoader over :class:`PillowImageFolder`, shuffled like a training run."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.DataLoader(PillowImageFolder(folder, size, seed=seed),
                                       batch_size=batch_size, shuffle=True, generator=g,
                                       num_workers=workers, persistent_workers=workers > 0,
                                       prefetch_factor=4 if workers > 0 else None)
