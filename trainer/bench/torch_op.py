"""torch's fused linear cross entropy (``F.linear_cross_entropy``, torch 2.14) set to instcls's problem.

instcls's classifier scores L2-normalised features against L2-normalised rows at temperature tau.
The same loss from torch's op: the input is ``normalize(x) / tau``, the linear weight
``normalize(W)``, the targets the instance ids, no label smoothing (the op has none).  Both
normalisations stay in autograd, so ``W.grad`` and ``x.grad`` are gradients of the same
parameters instcls's classifier updates.

The op's chunked path splits the *batch*: each chunk of ``batch_chunk_size`` rows computes its
``[rows, N]`` logits against all of W, and computes the gradients in the forward, adding the
chunk's share into a full ``N x D`` weight gradient.  So every chunk reads all of W and writes all
of its gradient; ``options=None`` (the reference path) is ``linear`` + ``cross_entropy`` with the
whole ``[B, N]`` logits and their gradient in memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trainer.bench.settings.torch_peer import AUTO, REFERENCE


def has_linear_cross_entropy() -> bool:
    return hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions")


def require_linear_cross_entropy() -> None:
    if not has_linear_cross_entropy():
        raise ValueError(
            f"the installed torch {torch.__version__} has no torch.nn.functional.linear_cross_entropy (with "
            "torch.nn.LinearCrossEntropyOptions), which --peer torch compares with; it ships with torch 2.14: "
            "install torch>=2.14, or run the bench without --peer")


@dataclass(frozen=True)
class TorchOpChoice:
    """One way to call the op: ``setting`` as named (``reference``, ``auto`` or a number) and the
    rows per chunk it comes to for a batch (None: the reference path, no chunks)."""

    setting: str
    batch_chunk_size: int | None

    @property
    def label(self) -> str:
        if self.batch_chunk_size is None:
            return REFERENCE
        return f"auto (chunk {self.batch_chunk_size})" if self.setting == AUTO else f"chunk {self.batch_chunk_size}"

    @property
    def as_setting(self) -> str:
        """The setting that gives this choice again for the same batch (``resolve``)."""
        if self.batch_chunk_size is None or self.setting == AUTO:
            return self.setting
        return str(self.batch_chunk_size)

    def options(self):
        """The ``options`` argument of ``F.linear_cross_entropy``."""
        if self.batch_chunk_size is None:
            return None
        if self.setting == AUTO:
            return torch.nn.LinearCrossEntropyOptions()
        return torch.nn.LinearCrossEntropyOptions(batch_chunk_size=self.batch_chunk_size, chunking_method=None)

    def weight_passes(self, batch: int) -> int:
        """How many times one call reads all of W (and, chunked, writes all of its gradient)."""
        return 1 if self.batch_chunk_size is None else math.ceil(batch / self.batch_chunk_size)


def auto_batch_chunk(batch: int, num_classes: int, dim: int, dtype: torch.dtype, device: torch.device) -> int:
    """The rows per chunk ``chunking_method="auto"`` resolves to for these shapes, from torch's own
    resolution (``LinearCrossEntropyOptions._adjust``, what ``F.linear_cross_entropy`` calls)."""
    require_linear_cross_entropy()
    resolved = torch.nn.LinearCrossEntropyOptions()._adjust(
        num_batches=batch, in_features=dim, num_classes=num_classes, dtype=dtype, device=device)
    return resolved.batch_chunk_size


def resolve(setting: str, batch: int, num_classes: int, dim: int, dtype: torch.dtype,
            device: torch.device) -> TorchOpChoice:
    """``setting`` for a batch of ``batch`` rows (a chunk size above the batch is one chunk)."""
    if setting == REFERENCE:
        return TorchOpChoice(setting, None)
    if setting == AUTO:
        return TorchOpChoice(setting, auto_batch_chunk(batch, num_classes, dim, dtype, device))
    return TorchOpChoice(setting, min(int(setting), batch))


def choices_in_memory_order(settings: tuple[str, ...], batch: int, num_classes: int, dim: int, dtype: torch.dtype,
                            device: torch.device) -> list[TorchOpChoice]:
    """The distinct ways ``settings`` call the op, the least memory first: chunked by growing chunk
    (its ``[chunk, N]`` logits), then the reference path (all ``[B, N]`` logits and their gradient)."""
    distinct: dict[int | None, TorchOpChoice] = {}
    for setting in settings:
        choice = resolve(setting, batch, num_classes, dim, dtype, device)
        distinct.setdefault(choice.batch_chunk_size, choice)
    return sorted(distinct.values(), key=lambda c: (c.batch_chunk_size is None, c.batch_chunk_size or 0))


def cosine_cross_entropy(features: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, temperature: float,
                         choice: TorchOpChoice) -> torch.Tensor:
    """Mean cross entropy of ``normalize(features) . normalize(weight)^T / temperature`` by torch's op;
    features in the step's dtype, the fp32 rows cast to it after normalising (as instcls does)."""
    require_linear_cross_entropy()
    inputs = F.normalize(features, dim=1) / temperature
    rows = F.normalize(weight, dim=1).to(features.dtype)
    return F.linear_cross_entropy(inputs, rows, ids, options=choice.options())
