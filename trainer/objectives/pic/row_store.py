"""Where a rank's classifier rows live when a step touches only a few of them (PIC sampling).

A ``RowStore`` holds, for the rows of this rank's shard, the weight W and its SGD momentum U side
by side (one ``[N_local, 2, D]`` tensor, so a row's W and U are one contiguous 1 KiB record at
D = 128) and the step each row was last brought up to date (``last_step``).  A step reads the rows
it needs to the compute device and writes them back later, so W and U need not be in device
memory at all:

* ``device``: on the GPU (or the CPU when there is none); fastest, costs ``2 N_local D`` device floats.
* ``host``: in host memory, pinned on GPU machines so the copies are asynchronous DMA.
* ``disk``: a memory-mapped file (and a small int32 file of ``last_step``) in a local directory.
  The page cache keeps what the steps use hot and the rank's anonymous memory does not grow with
  N.  Before a read the pages of the rows are advised (``MADV_WILLNEED``) so the kernel fetches
  them in parallel rather than one page fault at a time.  Use a local SSD (a k8s ``emptyDir``),
  not network storage.  An asynchronous checkpoint snapshots the rows into a file of the same
  size beside them (``checkpoint-snapshot-rows.bin``), so the directory needs twice the store.

Writes to a host or disk store from a GPU do not wait for it: the rows are copied into pinned
staging memory asynchronously, with an event, and put in place at the next read, fill or flush
(``settle``), by which time the copy has long finished.  A blocking device-to-host copy at every
write-back would stall the training thread once per step.
"""

from __future__ import annotations

import mmap
import shutil
import threading
from pathlib import Path

import numpy as np
import torch

from data_pipeline.contract import to_device

STORE_KINDS = ("device", "host", "disk")
BLOCK_ROWS = 1 << 16  # rows per block of a full pass (init, materialise, load): bounds temporaries to ~64 MiB


class RowStore:
    def __init__(self, rows: torch.Tensor, last_step: torch.Tensor, compute_device: torch.device, kind: str,
                 mapped: list[np.memmap] | None = None, directory: Path | None = None) -> None:
        self.rows, self.last_step = rows, last_step  # [N, 2, D] (W, U); [N] int32 on the CPU
        self.weight, self.momentum = rows[:, 0], rows[:, 1]  # views
        self.compute_device, self.kind = compute_device, kind
        self._mapped = mapped or []
        self.directory = directory  # a disk store's (local) directory
        self._pin = kind != "device" and compute_device.type == "cuda"
        # Staged writes not yet in place: (rows, staged [n, 2, D] pinned, copy-done event, step).
        self._staged: list[tuple[torch.Tensor, torch.Tensor, torch.cuda.Event, int]] = []
        self._staged_lock = threading.Lock()  # the prefetch thread settles while the training thread stages

    @property
    def num_rows(self) -> int:
        return self.rows.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.rows.dtype

    def _advise(self, rows: np.ndarray) -> None:
        """Ask the kernel to read the pages of ``rows`` now, all at once (disk stores only)."""
        if not self._mapped or rows.size == 0:
            return
        record = self.rows[0].numel() * self.rows.element_size()
        first = rows * record // mmap.PAGESIZE
        last = (rows * record + record - 1) // mmap.PAGESIZE
        span = int((last - first).max()) + 1  # pages one record can straddle
        for page in np.unique(np.concatenate([np.minimum(first + i, last) for i in range(span)])):
            self._mapped[0]._mmap.madvise(mmap.MADV_WILLNEED, int(page) * mmap.PAGESIZE, mmap.PAGESIZE)

    def read(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """``(W rows, U rows, last steps)``: W and U on the compute device, last steps on the host.
        ``rows``: int64 local row indices on the CPU."""
        self.settle()
        self._advise(rows.numpy())
        both = torch.index_select(self.rows, 0, to_device(rows, self.rows.device))
        if self._pin:
            both = both.pin_memory()
        both = both.to(self.compute_device, non_blocking=True)
        return both[:, 0], both[:, 1], self.last_step[rows].numpy().astype(np.int64)

    def write(self, rows: torch.Tensor, weight: torch.Tensor, momentum: torch.Tensor, step: int) -> None:
        """Store rows (distinct indices), up to date at ``step``; from a GPU, staged (see the module docstring)."""
        both = torch.stack([weight, momentum], dim=1).to(self.dtype)
        if not self._pin:
            self._put(rows, both.to(self.rows.device), step)
            return
        staged = torch.empty(both.shape, dtype=self.dtype, pin_memory=True)
        staged.copy_(both, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(self.compute_device))
        with self._staged_lock:
            self._staged.append((rows, staged, copied, step))

    def _put(self, rows: torch.Tensor, both: torch.Tensor, step: int) -> None:
        self.rows.index_copy_(0, to_device(rows, self.rows.device), both)
        self.last_step[rows] = step

    def settle(self) -> None:
        """Put every staged write in place (waiting for its copy, long done by now)."""
        with self._staged_lock:
            staged, self._staged = self._staged, []
            for rows, both, copied, step in staged:
                copied.synchronize()
                self._put(rows, both, step)

    def blocks(self):
        """Slices covering every row, ``BLOCK_ROWS`` at a time."""
        for start in range(0, self.num_rows, BLOCK_ROWS):
            yield slice(start, min(start + BLOCK_ROWS, self.num_rows))

    def fill(self, weight_rows, momentum_rows, step: int) -> None:
        """Overwrite every row from ``(start, end) -> tensor`` callables (a checkpoint, an init;
        ``momentum_rows`` None: zeros), block by block so that a disk store never holds more than
        a block in anonymous memory."""
        self.settle()
        for block in self.blocks():
            self.weight[block] = weight_rows(block.start, block.stop)
            self.momentum[block] = 0 if momentum_rows is None else momentum_rows(block.start, block.stop)
        self.last_step.fill_(step)

    def flush(self) -> None:
        """Put staged writes in place and write a disk store's dirty pages to the file (msync)."""
        self.settle()
        for array in self._mapped:
            array.flush()


def make_row_store(kind: str, num_rows: int, dim: int, dtype: torch.dtype, compute_device: torch.device,
                   directory: Path | None = None) -> RowStore:
    """An uninitialised store (``fill`` it).  ``directory``: where a ``disk`` store's files go."""
    if kind not in STORE_KINDS:
        raise ValueError(f"row_store={kind!r} is invalid: choose one of {STORE_KINDS}")
    shape = (num_rows, 2, dim)
    last_step = torch.zeros(num_rows, dtype=torch.int32)
    if kind == "device":
        return RowStore(torch.zeros(shape, dtype=dtype, device=compute_device), last_step, compute_device, kind)
    if kind == "host":
        pin = compute_device.type == "cuda"
        return RowStore(torch.zeros(shape, dtype=dtype, pin_memory=pin), last_step, compute_device, kind)
    if directory is None:
        raise ValueError("row_store='disk' needs row_store_dir: a directory on a local disk")
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
    mapped = [np.memmap(directory / "rows.bin", dtype=numpy_dtype, mode="w+", shape=shape),
              np.memmap(directory / "last_step.bin", dtype=np.int32, mode="w+", shape=(num_rows,))]
    return RowStore(torch.from_numpy(mapped[0]), torch.from_numpy(mapped[1]), compute_device, kind, mapped, directory)
