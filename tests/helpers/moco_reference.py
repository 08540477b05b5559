"""MoCo's loss over a queue and CO2's term on it, written from the papers' equations in float64.

The logits ``[B, 1 + K]`` exist in full and plain autograd differentiates them; nothing is shared
with ``trainer`` so that these can catch its mistakes.  Slot bookkeeping of the queue is replayed
with a plain list for the same reason.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reference_infonce(query, key, queue, temperature, consistency_temperature=None, alpha=0.0):
    """``(mean InfoNCE, mean CO2 term or None, dL/dquery, dL/dkey)`` of ``L = InfoNCE + alpha * term``
    (means over the batch).  ``query`` and ``key`` ``[B, D]`` unit rows, ``queue`` ``[K, D]`` unit rows.
    The key keeps its gradient here (a detached key is the same function of the query)."""
    q = query.detach().double().requires_grad_()
    k = key.detach().double().requires_grad_()
    n = queue.double()
    logits = torch.cat([(q * k).sum(dim=1, keepdim=True), q @ n.t()], dim=1) / temperature
    infonce = F.cross_entropy(logits, torch.zeros(q.shape[0], dtype=torch.int64))
    total, term = infonce, None
    if consistency_temperature is not None:
        log_q = torch.log_softmax(q @ n.t() / consistency_temperature, dim=1)  # the query's distribution Q
        log_p = torch.log_softmax(k @ n.t() / consistency_temperature, dim=1)  # the key's pseudo-labels P
        kl_pq = (log_p.exp() * (log_p - log_q)).sum(dim=1)
        kl_qp = (log_q.exp() * (log_q - log_p)).sum(dim=1)
        term = (0.5 * (kl_pq + kl_qp)).mean()
        total = infonce + alpha * term
    total.backward()
    return infonce.detach(), None if term is None else term.detach(), q.grad, k.grad


def replayed_slot_ids(size, steps_ids):
    """The sample id in each of ``size`` slots after writing each step's ids, in order, at a pointer
    that starts at 0 and wraps (-1: never written)."""
    slots, pointer = [-1] * size, 0
    for ids in steps_ids:
        for offset, sample in enumerate(ids):
            slots[(pointer + offset) % size] = int(sample)
        pointer = (pointer + len(ids)) % size
    return slots
