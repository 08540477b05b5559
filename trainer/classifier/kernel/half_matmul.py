"""Matmuls of half-precision (bf16/fp16) operands whose products are summed and written in fp32.

The chunked kernel's logits and gradients must not be rounded to half precision: a base-2 logit
reaches ``log2(e) / tau`` (~10 at tau 0.15), and bf16 keeps 8 bits, so a rounded logit is off by up
to 0.02 (a 1.4% error in every ``exp``), and a rounded gradient chunk is off by 2^-9 relative
before it is summed into the fp32 weight gradient.  Only the operands are half precision (what
tensor cores read); the accumulation and the output are fp32.

CUDA: ``torch.mm(a, b, out_dtype=torch.float32, out=out)`` runs cuBLAS with fp32 compute straight
into an fp32 matrix: the speed of a bf16-output GEMM, and no extra fp32 copy of a bf16 output.
``torch.mm(bf16, bf16, out=fp32)`` is refused, and ``addmm``'s ``out_dtype`` form is not used
because some torch releases refuse its fp32 ``self``: a shift or an accumulation is a separate
fp32 elementwise op, cheap next to the GEMM (1/D or 1/rows of its work).

CPUs have no ``out_dtype`` kernel (torch 2.14): the operands, rounded to the half dtype, are held in
fp32 and multiplied by the fp32 GEMM.  A product of two bf16 (or fp16) numbers is exact in fp32, so
this is the GPU's arithmetic up to summation order, and CPU tests check the numbers a GPU gets.
"""

from __future__ import annotations

import torch


class HalfOperands:
    """Rounded operands in reused buffers, and the fp32-output matmul of them."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"HalfOperands runs bf16/fp16 operands, got {dtype}")
        self.dtype, self.device = dtype, device
        self.on_gpu = device.type == "cuda"
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self._chunk: dict[str, tuple[torch.Tensor, float, torch.Tensor]] = {}
        self._features: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _buffer(self, name: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        numel = shape.numel()
        key = (name, dtype)
        if key not in self._buffers or self._buffers[key].numel() < numel:
            self._buffers[key] = torch.empty(numel, dtype=dtype, device=self.device)
        return self._buffers[key][:numel].view(shape)

    def new_chunk(self) -> None:
        """The chunk's tensors change (their buffers are rewritten): forget their operands."""
        self._chunk.clear()

    def rounded(self, name: str, tensor: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """``tensor * scale`` rounded once to the half dtype, as ``mm`` takes it; kept under ``name``
        until ``new_chunk`` (a chunk's weight rows and gradient feed two matmuls each)."""
        kept = self._chunk.get(name)
        if kept is not None and kept[0] is tensor and kept[1] == scale:
            return kept[2]
        # mul with a half-precision out computes in fp32 and rounds once on the write.
        half = self._buffer(name, tensor.shape, self.dtype)
        half = torch.mul(tensor, scale, out=half) if scale != 1.0 else half.copy_(tensor)
        operand = half if self.on_gpu else self._buffer(name, tensor.shape, torch.float32).copy_(half)
        self._chunk[name] = (tensor, scale, operand)
        return operand

    def features(self, features: torch.Tensor) -> torch.Tensor:
        """Features already in the half dtype, as ``mm`` takes them (kept for the whole pass: the
        kernel passes the same one or two feature tensors to every chunk)."""
        if features.dtype != self.dtype:
            raise ValueError(f"features are {features.dtype}, the operands {self.dtype}")
        if self.on_gpu:
            return features
        kept = self._features.get(id(features))
        if kept is None or kept[0] is not features:
            kept = (features, features.float())  # bf16 -> fp32 is exact
            self._features[id(features)] = kept
        return kept[1]

    def mm(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out = a @ b`` in fp32, for operands from ``rounded``/``features``."""
        if self.on_gpu:
            return torch.mm(a, b, out_dtype=torch.float32, out=out)
        return torch.mm(a, b, out=out)
