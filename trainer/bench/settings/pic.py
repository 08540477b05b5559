"""`instcls bench pic`'s settings: its command-line options (see ``trainer.bench.settings``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainer.bench.dataset_sizes import IMAGENET_1K, IMAGENET_21K


@dataclass(frozen=True)
class PicBenchSettings:
    """Attributes:
    sizes: comma-separated N; 'max' = the largest N whose store fits on the disk.
    batch: images per step, 2 views each.
    queue: K recent ids scored besides the batch.
    dim: feature dim D.
    chunk_size: classes per chunk of the full-softmax classifier and of the rows PIC scores.
    steps: timed steps per N.
    warmup: untimed steps per N.
    store: where PIC's rows (W and its momentum) live.
    store_dir: where a disk store goes (default: a temporary directory).
    cap_gib: full-softmax memory cap in GiB (the paper's 16 GB GPU).
    full_max_classes: time full-softmax steps up to this N only (a step is O(N)).
    """

    sizes: tuple[str, ...] = (str(IMAGENET_1K), str(IMAGENET_21K), "max")
    batch: int = 256
    queue: int = 65536
    dim: int = 128
    chunk_size: int = 65536
    steps: int = 10
    warmup: int = 2
    store: Literal["device", "host", "disk"] = "disk"
    store_dir: str | None = None
    cap_gib: float = 16.0
    full_max_classes: int = 2_000_000

    def row_bytes(self) -> int:
        return 2 * self.dim * 4 + 4  # W, momentum, last step
