"""The rows the last step updated stay on the compute device; the store sees only the rows that
enter and leave.

Consecutive PIC steps sample nearly the same rows (the K recent ids shift by one batch per step),
so re-reading and re-writing all K + B of them through a host or disk store each step would move
K rows for nothing, and on a memory-mapped file every 512-byte row dirties a whole 4 KiB page.
``WorkingSet`` keeps the last step's rows (current as of ``current_at``) and, for the next step's
rows, takes the ones it has, reads the new ones from the store (brought forward by
``LazyRowSGD``) and writes back the ones no longer needed, stamped with the step they are current
at.  Per step the store moves about B rows each way, independent of K and N.
"""

from __future__ import annotations

import numpy as np
import torch

from data_pipeline.contract import to_device
from trainer.objectives.pic.lazy_sgd import LazyRowSGD
from trainer.objectives.pic.row_store import RowStore


class WorkingSet:
    def __init__(self, store: RowStore, optimizer: LazyRowSGD) -> None:
        self.store, self.optimizer = store, optimizer
        self.rows = np.zeros(0, dtype=np.int64)  # local row indices held, sorted
        self.weight = self.momentum = None  # [len(rows), D] on the compute device, store dtype
        self.current_at = 0  # the step the held rows are up to date at
        self.corrected_rows = 0  # rows brought forward over skipped steps (a metric; main thread only)

    def new_rows(self, rows: np.ndarray) -> np.ndarray:
        """Which of ``rows`` (sorted) must come from the store."""
        return np.setdiff1d(rows, self.rows, assume_unique=True)

    def read_store(self, rows: np.ndarray, step: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Rows not held here, from the store, brought forward to ``step``, and how many of them
        moved (safe in a prefetch thread: it touches neither the held rows nor the store rows the
        main thread writes)."""
        weight, momentum, last = self.store.read(torch.from_numpy(rows))
        return weight, momentum, self.optimizer.bring_forward(weight, momentum, last, step)

    def gather(self, rows: np.ndarray, step: int, new=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows`` (sorted local indices) at ``step``, on the compute device; they become the held
        rows, and the returned tensors are updated in place by the optimizer.  ``new``: the store
        rows ``read_store(new_rows(rows), step)`` returned, if prefetched."""
        if self.weight is not None and self.current_at < step:  # a step passed without touching them
            last = np.full(self.rows.size, self.current_at)
            self.corrected_rows += self.optimizer.bring_forward(self.weight, self.momentum, last, step)
            self.current_at = step
        kept = np.isin(self.rows, rows, assume_unique=True)
        self._write_back(~kept)
        missing = self.new_rows(rows)
        new_weight, new_momentum, corrected = new if new is not None else self.read_store(missing, step)
        self.corrected_rows += corrected
        dim, device = self.store.weight.shape[1], self.store.compute_device
        weight = torch.empty(rows.size, dim, dtype=self.store.dtype, device=device)
        momentum = torch.empty_like(weight)
        if self.weight is not None and kept.any():
            at = to_device(np.searchsorted(rows, self.rows[kept]), device)
            source = to_device(np.flatnonzero(kept), device)
            weight[at], momentum[at] = self.weight[source], self.momentum[source]
        at = to_device(np.searchsorted(rows, missing), device)
        weight[at], momentum[at] = new_weight, new_momentum
        self.rows, self.weight, self.momentum, self.current_at = rows, weight, momentum, step
        return weight, momentum

    def stepped(self, step: int) -> None:
        """The held rows were updated by step ``step``."""
        self.current_at = step + 1

    def _write_back(self, leaving: np.ndarray) -> None:
        if self.weight is None or not leaving.any():
            return
        index = to_device(np.flatnonzero(leaving), self.weight.device)
        self.store.write(
            torch.from_numpy(self.rows[leaving]), self.weight[index], self.momentum[index], self.current_at
        )

    def flush(self) -> None:
        """Write every held row back; the store is then complete."""
        self._write_back(np.ones(self.rows.size, dtype=bool))
        self.store.settle()
        self.rows, self.weight, self.momentum = np.zeros(0, dtype=np.int64), None, None

    @torch.no_grad()
    def materialize(self, step: int) -> None:
        """Bring every row of the store to ``step`` (block by block) and forget the recorded steps."""
        self.flush()
        store = self.store
        for block in store.blocks():
            last = store.last_step[block].numpy().astype(np.int64)
            if (last < step).any():
                weight = store.weight[block].to(store.compute_device)
                momentum = store.momentum[block].to(store.compute_device)
                self.optimizer.bring_forward(weight, momentum, last, step)
                store.weight[block] = weight.to(store.weight.device)
                store.momentum[block] = momentum.to(store.momentum.device)
                store.last_step[block] = step
        self.optimizer.transitions.reset(step)
        self.current_at = step

    def reset(self, step: int) -> None:
        """Forget the held rows (the store was overwritten, e.g. by a checkpoint)."""
        self.rows, self.weight, self.momentum, self.current_at = np.zeros(0, dtype=np.int64), None, None, step
