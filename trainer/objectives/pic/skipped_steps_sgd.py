"""What torch's SGD does to a row that gets no gradient, over any run of steps, exactly.

With momentum m, weight decay lambda and learning rate eta_t, torch's SGD (no dampening, no
Nesterov) updates ``u <- m u + g + lambda w; w <- w - eta_t u``.  With ``g = 0`` that is linear in
``[w; u]``::

    [w; u] <- M_t [w; u],   M_t = [[1 - eta_t lambda, -eta_t m],
                                   [lambda,            m      ]]

so a row last updated before step s and next read at step t has skipped ``M_{t-1} ... M_s``.
PIC assumes a constant eta and takes a matrix power; our schedule (warm-up, cosine) changes eta
every step, so ``StepTransitions`` keeps every M_t in float64 in a segment tree whose node covering
steps ``[a, b)`` holds ``M_{b-1} ... M_a``: any gap is O(log steps) node products, for a whole
batch of rows at once.  Prefix products cannot be inverted instead: ``det M_t = m``, so the
inverse of a prefix grows like ``m^-t`` and overflows within a few thousand steps.
"""

from __future__ import annotations

import numpy as np

_IDENTITY = np.eye(2)


class StepTransitions:
    """The matrices of steps ``[base, base + count)``, appended one step at a time."""

    def __init__(self, momentum: float, weight_decay: float, base: int = 0, capacity: int = 1024) -> None:
        self.momentum, self.weight_decay = momentum, weight_decay
        self.reset(base, capacity)

    def reset(self, base: int, capacity: int = 1024) -> None:
        """Forget every step: valid once no row is behind ``base`` (e.g. after materialising all rows)."""
        self.base, self.count = base, 0
        self._size = 1 << max(1, capacity - 1).bit_length()
        self._tree = np.tile(_IDENTITY, (2 * self._size, 1, 1))  # leaves at [size, 2 size)

    @property
    def end(self) -> int:
        """The first step not recorded yet."""
        return self.base + self.count

    def matrix(self, lr: float) -> np.ndarray:
        m, wd = self.momentum, self.weight_decay
        return np.array([[1.0 - lr * wd, -lr * m], [wd, m]])

    def push(self, step: int, lr: float) -> None:
        """Record step ``step`` (the next one) taken with learning rate ``lr``."""
        self._append(step, self.matrix(lr))

    def push_skipped(self, step: int) -> None:
        """Record step ``step`` (the next one) as dropped: no row moved (``optim.on_nonfinite:
        skip_step``), the identity, which no learning rate gives (it would need momentum 1)."""
        self._append(step, _IDENTITY)

    def _append(self, step: int, matrix: np.ndarray) -> None:
        if step != self.end:
            raise ValueError(f"step {step} recorded out of order: the next step to record is {self.end}")
        if self.count == self._size:
            self._grow()
        node = self._size + self.count
        self._tree[node] = matrix
        self.count += 1
        node //= 2
        while node:
            # Later steps act after earlier ones: the right child multiplies from the left.
            self._tree[node] = self._tree[2 * node + 1] @ self._tree[2 * node]
            node //= 2

    def _grow(self) -> None:
        leaves = self._tree[self._size : self._size + self.count].copy()
        base, count = self.base, self.count
        self.reset(base, 2 * self._size)
        self._tree[self._size : self._size + count] = leaves
        self.count = count
        for node in range(self._size - 1, 0, -1):
            self._tree[node] = self._tree[2 * node + 1] @ self._tree[2 * node]

    def between(self, first: np.ndarray, end: int) -> np.ndarray:
        """``[n, 2, 2]``: ``M_{end-1} ... M_{first_i}`` for each ``first_i`` (identity where equal).

        The usual bottom-up segment-tree walk, vectorised over the rows: nodes met on the left are
        later than what is gathered so far (multiply on the left), on the right earlier."""
        first = np.asarray(first, dtype=np.int64)
        if end > self.end or end < self.base or (first.size and (first.min() < self.base or first.max() > end)):
            raise ValueError(f"steps [{first.min() if first.size else end}, {end}) are not all recorded "
                             f"(recorded: [{self.base}, {self.end}))")
        n = first.shape[0]
        left = np.tile(_IDENTITY, (n, 1, 1))
        right = np.tile(_IDENTITY, (n, 1, 1))
        lo = first - self.base + self._size
        hi = np.full(n, end - self.base + self._size, dtype=np.int64)
        while True:
            active = lo < hi
            if not active.any():
                break
            take = active & (lo & 1 == 1)
            left[take] = self._tree[lo[take]] @ left[take]
            lo[take] += 1
            take = active & (hi & 1 == 1)
            hi[take] -= 1
            right[take] = right[take] @ self._tree[hi[take]]
            lo >>= 1
            hi >>= 1
        return right @ left
