"""Sinkhorn-Knopp codes over the whole data-parallel batch (SwAV), in the log domain.

SwAV's codes ``Q [B, K]`` are ``exp(scores / eps)`` scaled so that every prototype gets the same
mass over the *global* batch (rows of the K x B matrix sum to 1/K) and every sample the same mass
(columns sum to 1/B), a few alternating normalisations from the start, then columns rescaled to 1.
Each rank holds its own samples, so the per-prototype sums are all-reduced; per-sample sums are
local.

Working with ``log Q`` instead of ``Q`` makes overflow impossible: each normalisation subtracts a
log-sum-exp, which is computed with its own max (per prototype: an all-reduce MAX, then an
all-reduce SUM of the shifted exponentials).  ``exp(scores / eps)`` itself, with scores up to
``1 / eps`` (unnormalised features) and eps = 0.05, would be ``exp(400)``: an inf in any float
type, and the NaN users report.  It runs in float32 or float64 whatever the engine's dtype
(half precision is the other known cause of NaN).

Padding repeats (``valid`` False) take no mass: their columns are excluded from the prototype
sums, the batch size is the number of valid samples, and their codes are 0.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from trainer.parallel.collectives import CommTimer, Group, all_reduce_


@torch.no_grad()
def distributed_sinkhorn(scores: torch.Tensor, epsilon: float, iterations: int, group: Group,
                         valid: torch.Tensor | None = None, total_valid: int | None = None,
                         dtype: torch.dtype = torch.float32, timer: CommTimer | None = None) -> torch.Tensor:
    """Codes ``[b, K]`` (``dtype``) of this rank's ``scores [b, K]``; each valid row sums to 1.

    ``total_valid``: valid samples over the group (known to the sampler; counted with one more
    all-reduce if None)."""
    log_q = scores.to(dtype) / epsilon
    num_prototypes = log_q.shape[1]
    if valid is None:
        valid = torch.ones(log_q.shape[0], dtype=torch.bool, device=log_q.device)
    if total_valid is None:
        count = valid.sum().to(dtype)
        total_valid = int(all_reduce_(count, dist.ReduceOp.SUM, group, timer))
    minus_inf = -math.inf  # a Python scalar: torch.tensor(..., device=cuda) would copy from the host each call
    log_q = torch.where(valid[:, None], log_q, minus_inf)
    log_k, log_b = math.log(num_prototypes), math.log(max(total_valid, 1))
    for _ in range(iterations):
        # Prototypes: sum over the global batch = 1/K.
        log_q = log_q - (_global_logsumexp_over_samples(log_q, group, timer) + log_k)[None, :]
        # Samples: sum over prototypes = 1/B.
        per_sample = torch.logsumexp(log_q, dim=1, keepdim=True)
        log_q = torch.where(valid[:, None], log_q - per_sample - log_b, minus_inf)
    return torch.exp(log_q + log_b)  # columns sum to 1


def _global_logsumexp_over_samples(log_q: torch.Tensor, group: Group, timer: CommTimer | None) -> torch.Tensor:
    """``log sum_b exp(log_q[b, k])`` over every rank's samples, ``[K]``."""
    peak = log_q.max(dim=0).values
    all_reduce_(peak, dist.ReduceOp.MAX, group, timer)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))  # a prototype no sample reaches
    sums = torch.exp(log_q - peak[None, :]).sum(dim=0)
    all_reduce_(sums, dist.ReduceOp.SUM, group, timer)
    return torch.log(sums) + peak
