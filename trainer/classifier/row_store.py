"""Where a rank's classifier rows live when a step touches only a few of them (PIC sampling).

A ``RowStore`` holds, for the rows ``[start, end)`` of this rank's shard, the weight W, its SGD
momentum U and the step each row was last brought up to date (``last_step``).  A step reads the
rows it samples to the compute device and writes them back after the update, so W and U need not
be in device memory at all:

* ``device``: on the GPU (or the CPU when there is none); fastest, costs ``2 N_local D`` device bytes.
* ``host``: in host memory, pinned on GPU machines so the copies are asynchronous DMA.
* ``disk``: two memory-mapped files (and a small int32 file of ``last_step``) in a local
  directory; the page cache keeps what the steps use hot, and the rank's anonymous memory does not
  grow with N.  Use a local SSD (a k8s ``emptyDir``), not network storage.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch

STORE_KINDS = ("device", "host", "disk")
BLOCK_ROWS = 1 << 16  # rows per block of a full pass (init, materialise, load): bounds temporaries to ~32 MiB


class RowStore:
    def __init__(self, weight: torch.Tensor, momentum: torch.Tensor, last_step: torch.Tensor,
                 compute_device: torch.device, kind: str) -> None:
        self.weight, self.momentum, self.last_step = weight, momentum, last_step
        self.compute_device, self.kind = compute_device, kind
        self._pin = kind != "device" and compute_device.type == "cuda"

    @property
    def num_rows(self) -> int:
        return self.weight.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    def _to_compute(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._pin:
            tensor = tensor.pin_memory()
        return tensor.to(self.compute_device, non_blocking=True)

    def read(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """``(W rows, U rows, last steps)``: W and U on the compute device, last steps on the host.
        ``rows``: int64 local row indices on the CPU."""
        index = rows.to(self.weight.device)
        weight = self._to_compute(torch.index_select(self.weight, 0, index))
        momentum = self._to_compute(torch.index_select(self.momentum, 0, index))
        return weight, momentum, self.last_step[rows].numpy().astype(np.int64)

    def write(self, rows: torch.Tensor, weight: torch.Tensor, momentum: torch.Tensor, step: int) -> None:
        """Store updated rows (distinct indices), now up to date at ``step``."""
        index = rows.to(self.weight.device)
        self.weight.index_copy_(0, index, weight.to(self.weight.device, self.dtype))
        self.momentum.index_copy_(0, index, momentum.to(self.momentum.device, self.dtype))
        self.last_step[rows] = step

    def blocks(self):
        """Slices covering every row, ``BLOCK_ROWS`` at a time."""
        for start in range(0, self.num_rows, BLOCK_ROWS):
            yield slice(start, min(start + BLOCK_ROWS, self.num_rows))

    def fill(self, weight_rows, momentum_rows, step: int) -> None:
        """Overwrite every row from ``(start, end) -> tensor`` callables (a checkpoint, an init),
        block by block so a disk store never holds more than a block in anonymous memory."""
        for block in self.blocks():
            self.weight[block] = weight_rows(block.start, block.stop)
            if momentum_rows is None:
                self.momentum[block] = 0
            else:
                self.momentum[block] = momentum_rows(block.start, block.stop)
        self.last_step.fill_(step)

    def flush(self) -> None:
        for array in getattr(self, "_mapped", ()):
            array.flush()


def make_row_store(kind: str, num_rows: int, dim: int, dtype: torch.dtype, compute_device: torch.device,
                   directory: Path | None = None) -> RowStore:
    """An uninitialised store (``fill`` it).  ``directory``: where a ``disk`` store's files go."""
    if kind not in STORE_KINDS:
        raise ValueError(f"row_store={kind!r} is invalid: choose one of {STORE_KINDS}")
    shape = (num_rows, dim)
    if kind == "device":
        make = lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=compute_device)  # noqa: E731
        store = RowStore(make(shape, dtype), make(shape, dtype), torch.zeros(num_rows, dtype=torch.int32),
                         compute_device, kind)
    elif kind == "host":
        pin = compute_device.type == "cuda"
        make = lambda shape, dtype: torch.zeros(shape, dtype=dtype, pin_memory=pin)  # noqa: E731
        store = RowStore(make(shape, dtype), make(shape, dtype), torch.zeros(num_rows, dtype=torch.int32),
                         compute_device, kind)
    else:
        if directory is None:
            raise ValueError("row_store='disk' needs row_store_dir: a directory on a local disk with room for "
                             f"{2 * num_rows * dim * torch.empty((), dtype=dtype).element_size() / 2**30:.1f} GiB")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        element = torch.empty((), dtype=dtype).element_size()
        needed = num_rows * (2 * dim * element + 4)
        free = shutil.disk_usage(directory).free + sum(f.stat().st_size for f in directory.glob("*.bin"))
        if needed > free:
            raise OSError(f"row_store_dir={str(directory)!r} has {free / 2**30:.1f} GiB free but the disk row store "
                          f"needs {needed / 2**30:.1f} GiB ({num_rows} rows x {dim} x 2 x {element} B); free space, "
                          "point row_store_dir at a larger local disk, or use more ranks")
        numpy_dtype = torch.empty((), dtype=dtype).numpy().dtype
        mapped = [np.memmap(directory / name, dtype=numpy_dtype, mode="w+", shape=shape)
                  for name in ("weight.bin", "momentum.bin")]
        mapped.append(np.memmap(directory / "last_step.bin", dtype=np.int32, mode="w+", shape=(num_rows,)))
        store = RowStore(*(torch.from_numpy(array) for array in mapped), compute_device, kind)
        store._mapped = mapped
    return store
