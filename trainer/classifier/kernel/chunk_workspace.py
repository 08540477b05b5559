"""Reused buffers and the per-chunk matmuls of the chunked cosine-softmax kernel.

Allocating fresh ``[chunk, B]`` and ``[chunk, D]`` tensors per chunk costs ~45% of a CPU step:
glibc returns large blocks to the OS on free, so every chunk page-faults its memory anew.  A
``ChunkWorkspace`` is allocated once per forward or backward and reused by every chunk; on GPUs the
caching allocator already reuses blocks, and the workspace costs nothing there.

Logits are laid out ``[rows, B]`` (a chunk's classes along the first dimension): the weight
gradient ``grad_logits @ features`` then reads them untransposed, which MKL runs ~15% faster than
the transposed form, and the forward and feature-gradient matmuls are as fast either way.

Matmuls of half-precision features read half-precision operands and sum and write fp32
(``trainer.classifier.kernel.half_matmul``); everything the loss or the fp32 weight's gradient accumulates
is fp32.  Half-precision features are used exactly as given: the kernel's ``log2(e)/tau`` rides on
the weight rows' rounding (which happens anyway) instead of a second rounding of the features.
"""

from __future__ import annotations

import math

import torch

from trainer.classifier.kernel.half_matmul import HalfOperands

NORM_EPS = 1e-12  # the epsilon of torch.nn.functional.normalize


class ChunkWorkspace:
    def __init__(self, batch: int, chunk_rows: int, dim: int, dtype: torch.dtype, device: torch.device,
                 gathers_rows: bool = False, weight_scale: float = 1.0) -> None:
        """``weight_scale``: with half-precision features, the factor the logits' weight operand is
        scaled by (fp32 features carry it themselves)."""
        self.batch, self.dtype, self.device = batch, dtype, device
        self._chunk_rows, self._dim = chunk_rows, dim
        self._lazy: dict[str, torch.Tensor] = {}
        self._half = HalfOperands(dtype, device) if dtype != torch.float32 else None
        self._weight_scale = weight_scale
        self._weight_hat = torch.empty(chunk_rows * dim, device=device)
        self._weight_norm = torch.empty(chunk_rows, device=device)
        # Sampled (non-contiguous) rows of W are gathered here before normalisation.
        self.gathered_rows = torch.empty(chunk_rows * dim if gathers_rows else 0, device=device)

    def _buffer(self, name: str, per_row: int) -> torch.Tensor:
        """A buffer of ``chunk_rows * per_row`` fp32 values, allocated on first use: a forward never
        pays for the backward's buffers, nor for the logits buffer when the logits cache holds them."""
        if name not in self._lazy:
            self._lazy[name] = torch.empty(self._chunk_rows * per_row, device=self.device)
        return self._lazy[name]

    def block(self, name: str, rows: int, *shape: int) -> torch.Tensor:
        """A reused contiguous fp32 ``[rows, *shape]`` buffer (per-chunk scratch of a loss term)."""
        per_row = math.prod(shape)
        return self._buffer(name, per_row)[: rows * per_row].view(rows, *shape)

    def logits(self, rows: int) -> torch.Tensor:
        """The reused fp32 ``[rows, B]`` buffer."""
        return self._buffer("logits", self.batch)[: self.batch * rows].view(rows, self.batch)

    def normalized_rows(self, weight_chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w / |w|, |w|)`` per row in fp32, the norm clamped like ``F.normalize``."""
        rows, dim = weight_chunk.shape
        if self._half is not None:
            self._half.new_chunk()  # the buffers below are rewritten: the last chunk's operands go
        norm = torch.linalg.vector_norm(weight_chunk, dim=1, out=self._weight_norm[:rows]).clamp_min_(NORM_EPS)[:, None]
        weight_hat = torch.div(weight_chunk, norm, out=self._weight_hat[: rows * dim].view(rows, dim))
        return weight_hat, norm

    def cosine_logits(self, scaled_features: torch.Tensor, weight_hat: torch.Tensor, out: torch.Tensor,
                      shift: torch.Tensor | None = None) -> torch.Tensor:
        """``out = weight_hat @ scaled_features.T - shift[None, :]`` (fp32 ``[rows, B]``); the
        subtraction rides along with the matmul's output write."""
        if self._half is None:
            if shift is None:
                return torch.mm(weight_hat, scaled_features.t(), out=out)
            return torch.addmm(shift[None, :], weight_hat, scaled_features.t(), beta=-1, out=out)
        weights = self._half.rounded("scaled_weight_hat", weight_hat, self._weight_scale)
        self._half.mm(weights, self._half.features(scaled_features).t(), out)
        return out if shift is None else out.sub_(shift[None, :])

    def add_grad_features(
        self, grad_features: torch.Tensor, grad_logits: torch.Tensor, weight_hat: torch.Tensor
    ) -> None:
        """``grad_features += grad_logits.T @ weight_hat`` (fp32 accumulator)."""
        if self._half is None:
            grad_features.addmm_(grad_logits.t(), weight_hat)
            return
        part = self._lazy.get("grad_features_part")
        if part is None:
            part = self._lazy["grad_features_part"] = torch.empty_like(grad_features)
        grads = self._half.rounded("grad_logits", grad_logits)
        grad_features += self._half.mm(grads.t(), self._half.rounded("weight_hat", weight_hat), part)

    def grad_weight_rows(
        self,
        grad_logits: torch.Tensor,
        features: torch.Tensor,
        weight_hat: torch.Tensor,
        norm: torch.Tensor,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """fp32 ``[rows, D]`` gradient w.r.t. the *unnormalised* weight rows of the chunk, for logits
        ``z = (weight_hat @ features.T) / scale``; written into ``out`` (e.g. the rows of a full
        gradient) when given, saving a copy."""
        rows, dim = weight_hat.shape
        if out is None:
            out = self._buffer("grad_weight_hat", self._dim)[: rows * dim].view(rows, dim)
        if self._half is None:
            grad_weight_hat = torch.mm(grad_logits, features, out=out)
        else:
            grads = self._half.rounded("grad_logits", grad_logits)
            grad_weight_hat = self._half.mm(grads, self._half.features(features), out)
        # Backward of w / |w|: remove the radial component, divide by the norm (and the scale).
        products = torch.mul(
            grad_weight_hat, weight_hat, out=self._buffer("products", self._dim)[: rows * dim].view(rows, dim)
        )
        radial = torch.sum(products, dim=1, out=self._buffer("radial", 1)[:rows])
        factor = torch.reciprocal(norm, out=self._buffer("factor", 1)[:rows, None]).mul_(1.0 / scale)
        return grad_weight_hat.addcmul_(weight_hat, radial[:, None], value=-1).mul_(factor)


class LogitsCache:
    """The forward's ``exp(z)`` of every scored row, kept for the backward, chunk after chunk.

    Each chunk's ``[rows, B]`` block is contiguous (chunk-major layout), so the forward's matmul
    writes straight into it and the backward reads it back with no recomputation.

    A released CPU cache is kept for the next forward: a fresh buffer page-faults its memory anew
    (glibc unmaps big blocks on free), ~0.2 s per 512 MB and step, as long as a whole matmul.  One
    buffer per device is kept, so at most ``logits_cache_bytes`` stays resident between steps; a
    second cache alive at the same time (two forwards before one backward) gets its own buffer.
    GPUs need none of this: the caching allocator already reuses the block.
    """

    _idle: dict[torch.device, torch.Tensor] = {}

    def __init__(self, batch: int, rows: int, device: torch.device) -> None:
        self.batch = batch
        idle = self._idle.pop(device, None)
        if idle is None or idle.numel() < batch * rows:
            idle = torch.empty(batch * rows, device=device)
        self._values = idle[: batch * rows]

    @staticmethod
    def size_bytes(batch: int, rows: int) -> int:
        return batch * rows * 4

    def chunk(self, start: int, end: int) -> torch.Tensor:
        return self._values[self.batch * start : self.batch * end].view(end - start, self.batch)

    def release(self) -> None:
        """Done with the values (after the backward); CPU memory goes back to the idle buffer."""
        values, self._values = self._values, None
        if values.device.type == "cpu":
            kept = self._idle.get(values.device)
            whole = values if values._base is None else values._base
            if kept is None or kept.numel() < whole.numel():
                self._idle[values.device] = whole
