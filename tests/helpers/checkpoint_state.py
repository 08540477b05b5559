"""Small pieces the checkpoint tests share: a row-sharded component and a file-size limit that makes a
write fail the way a full disk does."""

from __future__ import annotations

import resource
import signal
from contextlib import contextmanager

import torch

from trainer.parallel.sharded_state import ShardedRows


class RowTable:
    """A component whose whole state is one row-sharded table (this process holds every row)."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def state_dict(self) -> dict:
        return {"rows": ShardedRows(self.rows, 0, len(self.rows), len(self.rows))}

    def load_state_dict(self, state: dict) -> None:
        self.rows = state["rows"].rows


@contextmanager
def file_size_limit(limit_bytes: int):
    """Writes past ``limit_bytes`` fail with EFBIG (SIGXFSZ ignored, so the test process lives on)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
