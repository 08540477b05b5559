"""A roofline for one classifier step per path: the least time its matmuls, its exponentials and its
memory traffic can take on this device, each at the rate measured (or, for ``exp2``, specified) for it.

Per rank, ``S`` samples are scored against ``R`` rows of dimension ``D`` (``e`` bytes per feature
element).  What each path executes (docs/benchmarks.md, "The classifier's memory traffic"):

==================  ================  ==========  ============================================
path                matmul FLOPs      exp2        bytes through memory
==================  ================  ==========  ============================================
chunked, recompute  8 S R D           2 S R       per logit: forward 16 (matmul write, exp2 in
                                                  place, sum); backward 20 in fp32 (matmul write
                                                  with the shift, exp2 in place, two matmul
                                                  reads), 30 with half features (the shift is a
                                                  separate pass, the gradient is rounded to half)
chunked, cache      6 S R D           S R         forward 16; backward 16 fp32, 18 half (rescale
                                                  the cached exp(z) in place, round, two reads)
fused               10 S R D          3 S R       no logits: W read by each of 3 kernels and for
                                                  its norms, W's gradient written; the features'
                                                  partial gradients (SPLITS x S x D fp32) written
                                                  and summed
==================  ================  ==========  ============================================

Every path also runs the optimizer over the rows (SGD with momentum: read W, its gradient and
momentum, write W and momentum: 20 R D bytes), and the chunked paths read and write the rows'
normalised and rounded copies per pass (~(8 + e) R D each of 3 passes).  Re-reads that a tile
schedule serves from L2 (the features by every row block, W by every feature block) are not
counted: the roofline is what no schedule can beat.
"""

from __future__ import annotations

import torch

MATMUL_PASSES = {"chunked/recompute": 4, "chunked/cache": 3, "fused/recompute": 5}  # x 2 S R D FLOPs
EXP2_PASSES = {"chunked/recompute": 2, "chunked/cache": 1, "fused/recompute": 3}  # x S R
EXP2_PER_CLOCK_PER_SM = 16  # Hopper's special-function units (CUDA C guide, throughput of exp2 for cc 9.0)
FUSED_SPLITS = 9  # about splits_for at S = 8192 on 132 multiprocessors


def exp2_rate(device: torch.device) -> float | None:
    """exp2 results per second a GPU's special-function units deliver (None on CPUs: not modelled)."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return props.multi_processor_count * EXP2_PER_CLOCK_PER_SM * props.clock_rate * 1e3  # clock_rate is kHz


def bytes_moved(path: str, scored: int, rows: int, dim: int, element: int) -> int:
    """Bytes a path moves through device memory in one step (module docstring)."""
    logits = scored * rows
    half = element < 4
    optimizer = 20 * rows * dim
    if path == "fused/recompute":
        weights = (3 + 1) * 4 * rows * dim + 4 * rows * dim  # 3 kernels + norms read W, dW written
        partials = 2 * FUSED_SPLITS * scored * dim * 4 + 3 * scored * dim * element
        return weights + partials + optimizer
    per_logit = 16 + ((30 if half else 20) if path == "chunked/recompute" else (18 if half else 16))
    copies = 3 * (8 + element) * rows * dim
    return per_logit * logits + copies + optimizer


def roofline(path: str, scored: int, rows: int, dim: int, element: int, matmul_gflops: float,
             copy_gb_per_s: float, exp2_per_s: float | None) -> dict:
    """``seconds`` (the largest of the three), and each term with the counts it came from."""
    flops = MATMUL_PASSES[path] * 2 * scored * rows * dim
    exponentials = EXP2_PASSES[path] * scored * rows
    moved = bytes_moved(path, scored, rows, dim, element)
    terms = dict(matmul_s=flops / (matmul_gflops * 1e9), memory_s=moved / (copy_gb_per_s * 1e9),
                 exp2_s=exponentials / exp2_per_s if exp2_per_s else 0.0)
    return dict(seconds=max(terms.values()), bound=max(terms, key=terms.get).removesuffix("_s"), flops=flops,
                exp2=exponentials, bytes=moved, **terms)
