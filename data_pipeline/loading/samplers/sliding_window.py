"""The sliding-window sampler of the PIC paper (Algorithm 3): steps read windows of W ids that
slide by S over one fixed permutation, so every id lies in about W/S consecutive windows and is
revisited within a short span of steps instead of once per epoch (its classifier weight is
updated often).

Contract (``SlidingWindowSampler``, ``kind: sliding_window``), for N ids and seed ``seed``:

* ``perm = np.random.default_rng([seed, 0x5717]).permutation(N)``, drawn once for the whole run.
* Window k (k = 0, 1, ...) holds ``w_k[i] = perm[(k*S + i) mod N]`` for ``i < W`` (wrapping modulo
  N, not modulo W as PIC's public code does), and is read in the order
  ``o_k = np.random.default_rng([seed, 0x5717, k]).permutation(W)``: ``w_k[o_k[0]], w_k[o_k[1]], ...``.
* The windows, concatenated, form one endless stream: position p reads window ``p // W`` at
  ``o_k[p % W]``.  Global step ``g = epoch * steps_per_epoch + step`` reads positions
  ``[g*Bg, (g+1)*Bg)``, ``Bg = world_size * batch_size``, and rank r takes
  ``g*Bg + r*b .. g*Bg + (r+1)*b``.  So a step's samples depend only on the global batch (a run
  resharded with the same global batch continues identically), any step is computed without the
  ones before it (exact resume, also mid-window), and a batch may straddle windows (more than
  two only when Bg > W).
* ``steps_per_epoch = ceil(N / Bg)``; every sample is valid (no padding; ``last_batch`` does not
  apply).  E epochs read about E*N samples, i.e. ``ceil(E*N / W)`` windows, the last one cut
  where the run ends.  W > N is allowed: a window then repeats ``perm``, as the formula says.
  Since every window is read whole, an epoch slides the start by only N*S/W (N/8 with the
  defaults): a full sweep of the permutation takes W/S epochs and reads each id W/S times, once
  per epoch on average, each time within a few windows of the last.  Runs shorter than W/S
  epochs see only part of the ids.
* Auto sizes (``window_size=0`` / ``stride=0``):
  ``W = min(2**17, max(Bg, 2**round(log2(N / 10))))``, keeping ImageNet's N/W ~ 10 (1.28M ids ->
  W = 2**17) while never going below one global batch on small sets; ``S = max(1, W // 8)``, the
  paper's 87.5% overlap.  Explicit positive values are used as given; S must not exceed W.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict

import numpy as np

from data_pipeline.loading.samplers.base import StepIndices, check_state

STREAM_KEY = 0x5717  # separates these generators from the epoch permutations of the same seed
MAX_AUTO_WINDOW = 2**17
CACHED_WINDOWS = 2  # consecutive steps read the current window and at most the next one


def resolve_sizes(num_samples: int, global_batch: int, window_size: int = 0, stride: int = 0) -> tuple[int, int]:
    """``(W, S)`` after applying the auto rules of the module docstring to zeros."""
    if window_size < 0:
        raise ValueError(f"data.loader.sampler.window_size={window_size} is invalid: use 0 (auto) or a positive size")
    if stride < 0:
        raise ValueError(f"data.loader.sampler.stride={stride} is invalid: use 0 (auto) or a positive stride")
    if window_size == 0:
        # max(0, ...) only keeps the power integral for N < 10; Bg >= 1 dominates there anyway.
        window_size = min(MAX_AUTO_WINDOW, max(global_batch, 2 ** max(0, round(math.log2(num_samples / 10)))))
    if stride == 0:
        stride = max(1, window_size // 8)
    if stride > window_size:
        raise ValueError(f"data.loader.sampler.stride={stride} exceeds the window size {window_size}: ids between "
                         "windows would never be read; use a stride <= window_size (or 0 for window_size // 8)")
    return window_size, stride


class SlidingWindowSampler:
    """PIC's sliding-window order over all ids, read one global batch per step (see the module docstring)."""

    KIND = "sliding_window"

    def __init__(self, num_samples: int, world_size: int, batch_size: int, seed: int = 0, window_size: int = 0,
                 stride: int = 0) -> None:
        if num_samples < 1:
            raise ValueError(f"the sliding-window sampler needs at least one sample, got {num_samples}")
        self.num_samples, self.world_size, self.batch_size, self.seed = num_samples, world_size, batch_size, seed
        self.global_batch = world_size * batch_size
        self.window_size, self.stride = resolve_sizes(num_samples, self.global_batch, window_size, stride)
        self.steps_per_epoch = math.ceil(num_samples / self.global_batch)
        # int32 halves the one big array (50M ids: 200 MB instead of 400 MB); same draws as permutation(N).
        dtype = np.int32 if num_samples < 2**31 else np.int64
        self.perm = np.random.default_rng([seed, STREAM_KEY]).permutation(np.arange(num_samples, dtype=dtype))
        self._windows: OrderedDict[int, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()  # a loader's reader thread and the trainer both ask for steps

    def window(self, k: int) -> np.ndarray:
        """Window k's ids in the order they are read (the last ``CACHED_WINDOWS`` are cached)."""
        with self._lock:
            if k not in self._windows:
                order = np.random.default_rng([self.seed, STREAM_KEY, k]).permutation(self.window_size)
                start = (k * self.stride) % self.num_samples  # Python int: no overflow for any k
                self._windows[k] = self.perm[(start + order) % self.num_samples]
                if len(self._windows) > CACHED_WINDOWS:
                    self._windows.popitem(last=False)
            self._windows.move_to_end(k)
            return self._windows[k]

    def step(self, epoch: int, step: int) -> StepIndices:
        if not 0 <= step < self.steps_per_epoch:
            raise IndexError(f"step {step} is outside [0, {self.steps_per_epoch}) of this sampler's epochs")
        if epoch < 0:
            raise IndexError(f"epoch {epoch} is negative")
        first = (epoch * self.steps_per_epoch + step) * self.global_batch  # stream position of rank 0's first id
        end, W = first + self.global_batch, self.window_size
        parts = []
        for k in range(first // W, (end - 1) // W + 1):  # usually one window, two where the batch straddles
            lo, hi = max(first, k * W) - k * W, min(end, (k + 1) * W) - k * W
            parts.append(self.window(k)[lo:hi])
        ids = np.concatenate(parts).astype(np.int64).reshape(self.world_size, self.batch_size)
        return StepIndices(ids=ids, valid=np.ones(ids.shape, dtype=bool))

    def state_dict(self) -> dict:
        return {"kind": self.KIND, "num_samples": self.num_samples, "seed": self.seed,
                "window_size": self.window_size, "stride": self.stride, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict) -> None:
        expected = {key: value for key, value in self.state_dict().items() if key != "kind"}
        check_state(self.KIND, expected, state)
