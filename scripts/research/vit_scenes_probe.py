"""A one-process probe of what a ViT-Ti learns on the demo's digit scenes, and how fast.

Not the product: no ranks, no DALI, no DeepSpeed.  It exists to answer questions that a 6-minute
`instcls train` run answers too slowly, or cannot ask at all:

- ``--mode sup``: does the network learn the digits *with* their labels in N steps?  (The trainer
  has no supervised objective.)  If it cannot, no self-supervised objective will in N steps.
- ``--mode instance``: the paper's parametric instance classifier in miniature: one cosine row per
  training image (contrastive prior init), temperature ``--tau``, rows stepped by SGD at
  ``--row-lr`` on the backbone's schedule.
- ``--mode simclr``: in-batch contrast of the two views instead of rows.

Both views use the demo's augmentation (torchvision's ops with the same parameters as
``configs/demo_cpu.yaml``).  The network is timm's ViT-Ti at ``--patch``, or with ``--input-norm``
the same behind a per-image, per-channel standardisation (``nn.InstanceNorm2d(3)``).  kNN (k=20,
cosine, temperature 0.07, the trainer's settings) on the class token scores the held-out split
every ``--eval-every`` steps.

Run from the repository root after ``make demo`` wrote the shards:
``.venv/bin/python -m scripts.research.vit_scenes_probe --mode sup --patch 8 --steps 1000``.
docs/results.md lists what it measured.
"""

from __future__ import annotations

import argparse
import io
import math
import time
from pathlib import Path

import numpy as np
import timm
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn
from torchvision.transforms import v2 as T

from data_pipeline.shardset.manifest import MANIFEST_NAME
from data_pipeline.shardset.sample_table import sample_table
from trainer.evaluation.knn import knn_accuracy

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", default="out/demo/shards", help="folder with train/ and val/ (make demo's)")
    p.add_argument("--mode", choices=("sup", "instance", "simclr"), default="instance")
    p.add_argument("--patch", type=int, default=4)
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--pool", choices=("token", "avg"), default="token",
                   help="the feature: the class token, or the mean of the patch tokens (timm's global_pool)")
    p.add_argument("--pos-embed", choices=("learn", "none"), default="learn",
                   help="none: no position embedding (a bag of patches, blind to where the digit is)")
    p.add_argument("--input-norm", action="store_true", help="standardise each image's channels first")
    p.add_argument("--patch-drop", type=float, default=0.0, help="timm's patch_drop_rate (training only)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=64, help="images per step (two views each)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW's peak learning rate")
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--warmup", type=int, default=30, help="steps of linear warm-up, then cosine to 0")
    p.add_argument("--tau", type=float, default=0.15)
    p.add_argument("--row-lr", type=float, default=0.24)
    p.add_argument("--crop", type=float, default=0.5, help="smallest crop scale")
    p.add_argument("--jitter", type=float, default=0.8, help="colour jitter strength (0: none)")
    p.add_argument("--gray", type=float, default=0.5, help="grayscale probability")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args()


def load_split(folder: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sample of a make-shards folder, by id: uint8 images [n, 3, h, w] and labels [n]."""
    if not (Path(folder) / MANIFEST_NAME).exists():
        raise SystemExit(f"no shards in {folder}: run `make demo` first (it writes out/demo/shards), or pass --shards")
    table = sample_table(Path(folder))
    images = [np.array(Image.open(io.BytesIO(table.read_jpeg(i))).convert("RGB")) for i in range(table.num_samples)]
    labels = [table.read_label(i) for i in range(table.num_samples)]
    return torch.tensor(np.stack(images)).permute(0, 3, 1, 2).contiguous(), torch.tensor(labels)


def normalise(images: torch.Tensor) -> torch.Tensor:
    return (images.float() / 255 - MEAN) / STD


def main() -> None:
    a = parse_args()
    torch.manual_seed(a.seed)
    np.random.seed(a.seed)
    torch.set_num_threads(a.threads)
    train_x, train_y = load_split(f"{a.shards}/train")
    val_x, val_y = load_split(f"{a.shards}/val")
    hue = min(0.5, a.jitter * 0.625)  # 0.5 at the demo's 0.8
    augment = T.Compose([T.RandomResizedCrop(32, scale=(a.crop, 1.0), antialias=True),
                         T.RandomApply([T.ColorJitter(a.jitter, a.jitter, a.jitter, hue)], p=1.0),
                         T.RandomGrayscale(a.gray), T.GaussianBlur(3, (0.1, 1.0))])

    def views(idx: torch.Tensor) -> torch.Tensor:
        return normalise(torch.stack([augment(train_x[i]) for i in idx]))

    net: nn.Module = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0, img_size=32,
                                       patch_size=a.patch, dynamic_img_size=True, patch_drop_rate=a.patch_drop,
                                       depth=a.depth, global_pool=a.pool, pos_embed=a.pos_embed)
    if a.input_norm:
        net = nn.Sequential(nn.InstanceNorm2d(3), net)
    head: nn.Module = nn.Sequential(nn.Linear(192, 512), nn.BatchNorm1d(512), nn.ReLU(), nn.Linear(512, 128))
    if a.mode == "sup":
        head = nn.Linear(192, 10)
    params = [q for q in list(net.parameters()) + list(head.parameters()) if q.requires_grad]
    optimizer = torch.optim.AdamW([{"params": [q for q in params if q.ndim >= 2], "weight_decay": a.weight_decay},
                                   {"params": [q for q in params if q.ndim < 2], "weight_decay": 0}], lr=a.lr)

    @torch.no_grad()
    def features(images: torch.Tensor) -> torch.Tensor:
        net.eval()
        out = torch.cat([net(normalise(images[i:i + 256])) for i in range(0, len(images), 256)])
        net.train()
        return F.normalize(out, dim=1)

    def held_out_knn() -> float:
        """The trainer's kNN (k=20, t=0.07) of the held-out split against the training images, in %."""
        head.eval()
        accuracy = knn_accuracy(features(train_x), train_y, features(val_x), val_y, k=20, temperature=0.07)
        head.train()
        return accuracy * 100

    n = len(train_x)
    rows = None
    if a.mode == "instance":  # contrastive prior: each row starts as its image's feature
        with torch.no_grad():
            head.eval()
            net.eval()
            rows = F.normalize(torch.cat([head(net(normalise(train_x[i:i + 256]))) for i in range(0, n, 256)]), dim=1)
            net.train()
            head.train()
    print(f"step 0 knn {held_out_knn():.2f}", flush=True)
    start = time.time()
    order, pos = torch.randperm(n), 0
    for step in range(1, a.steps + 1):
        if pos + a.batch > n:
            order, pos = torch.randperm(n), 0
        idx = order[pos:pos + a.batch]
        pos += a.batch
        lr = a.lr * min(1, step / a.warmup) * 0.5 * (1 + math.cos(math.pi * step / a.steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        x = torch.cat([views(idx), views(idx)])
        if a.mode == "sup":
            loss = F.cross_entropy(head(net(x)), torch.cat([train_y[idx], train_y[idx]]))
        elif a.mode == "simclr":
            z = F.normalize(head(net(x)), dim=1)
            b = len(idx)
            logits = z @ z.T / a.tau
            logits.fill_diagonal_(-1e9)
            loss = F.cross_entropy(logits, torch.cat([torch.arange(b, 2 * b), torch.arange(0, b)]))
        else:
            z = F.normalize(head(net(x)), dim=1)
            weights = rows.clone().requires_grad_(True)
            loss = F.cross_entropy(z @ weights.T / a.tau, torch.cat([idx, idx]))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        if rows is not None:
            with torch.no_grad():
                rows = F.normalize(rows - a.row_lr * (lr / a.lr) * weights.grad, dim=1)
        if step % a.eval_every == 0 or step == a.steps:
            print(f"step {step} loss {loss.item():.3f} knn {held_out_knn():.2f} ({time.time() - start:.0f}s)",
                  flush=True)


if __name__ == "__main__":
    main()
