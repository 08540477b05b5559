"""Which local rows of the weight shard the kernel scores: all, a contiguous window, or sampled rows.

Full-softmax training scores every local row; partial methods (e.g. PIC) score a window or a sample
of rows.  Positions ``0 .. count-1`` number the scored rows; target columns and chunks refer to
these positions, and ``ScoredRows`` maps them back to rows of W for reading and for gradients.
"""

from __future__ import annotations

import torch


class ScoredRows:
    def __init__(self, rows: slice | torch.Tensor | None, num_local_rows: int) -> None:
        """``rows``: ``None`` (all rows), ``slice(a, b)`` (step 1) or an int64 tensor of row indices."""
        self.indices: torch.Tensor | None = None
        if rows is None:
            rows = slice(0, num_local_rows)
        if isinstance(rows, slice):
            start, stop, step = rows.indices(num_local_rows)
            if step != 1:
                raise ValueError(f"rows={rows}: a window of rows must be contiguous (step 1)")
            self.offset, self.count = start, max(0, stop - start)
        else:
            if rows.dtype != torch.int64 or rows.dim() != 1:
                raise ValueError(
                    f"rows must be a 1-D int64 tensor of local row indices, got {rows.dtype} {tuple(rows.shape)}"
                )
            self.indices, self.offset, self.count = rows, 0, rows.shape[0]

    def chunks(self, chunk_size: int):
        """``(start, end)`` positions of consecutive chunks of the scored rows."""
        for start in range(0, self.count, chunk_size):
            yield start, min(start + chunk_size, self.count)

    def num_chunks(self, chunk_size: int) -> int:
        return -(-self.count // chunk_size)

    def read(self, weight: torch.Tensor, start: int, end: int, gather_buffer: torch.Tensor) -> torch.Tensor:
        """Rows of W at positions ``[start, end)``: a view for windows, gathered into the buffer otherwise."""
        if self.indices is None:
            return weight[self.offset + start : self.offset + end]
        out = gather_buffer[: (end - start) * weight.shape[1]].view(end - start, weight.shape[1])
        return torch.index_select(weight, 0, self.indices[start:end], out=out)

    def gradient_for(self, weight: torch.Tensor) -> torch.Tensor:
        """A gradient buffer for ``weight``: uninitialised when the scored rows are all of W (every row
        will be written), zeros otherwise (only the scored rows are touched)."""
        covers_all = self.indices is None and self.count == weight.shape[0]
        return torch.empty_like(weight) if covers_all else torch.zeros_like(weight)

    def rows_of(self, start: int, end: int) -> slice | torch.Tensor:
        """Rows of W at positions ``[start, end)``, as a slice or an index tensor."""
        if self.indices is None:
            return slice(self.offset + start, self.offset + end)
        return self.indices[start:end]
