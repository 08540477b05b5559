"""MoCo's InfoNCE over the sharded queue, and CO2's consistency term on the same pass.

Per query ``q_i`` (L2-normalised) of the group's batch, with its positive key ``k_i`` and the
queue's K keys ``n_j`` (split over the group's ranks, ``key_queue``)::

    l_pos = <q_i, k_i> / tau,   l_neg,j = <q_i, n_j> / tau,   L_i = -log softmax([l_pos, l_neg])_0

which is ``F.cross_entropy`` on the ``[B, 1 + K]`` logits with target 0.  The sharded kernel
(``trainer.classifier.kernel.chunked``) scores the queue a chunk at a time with the positive as a
per-sample logit that is no row, and the queue gets no gradient.

CO2 (Wei et al., ICLR 2021) adds ``alpha * 1/2 (KL(P||Q) + KL(Q||P))`` with ``Q = softmax(q n_j /
tau_con)`` and ``P = softmax(k n_j / tau_con)`` over the queue: the positive key's similarities to the
queue are the query's pseudo-labels.  It is the kernel's CO2 term (``trainer.classifier.terms.co2``)
with the key as the second view of each sample: the kernel's columns are then every rank's
``[queries; keys]``, the keys' own cross-entropy is computed and dropped (its gradient is zero),
and the term's sums travel in the same two all-reduces.  The keys' columns double the chunk
matmuls of the forward, which P needs anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.classifier.kernel.chunked import KernelSettings, sharded_cosine_ce, sharded_cosine_ce_with_term
from trainer.classifier.terms.co2 import ConsistencySettings, ConsistencyTerm
from trainer.parallel.collectives import CommTimer, Group, all_gather_rows_with_grad, group_size, scale_grad

MOCO_TEMPERATURE = 0.2  # MoCo v2's tau
QUERY, KEY = 0, 1  # the two "views" of a sample in the kernel's columns when CO2 runs


@dataclass
class QueueLoss:
    """Per query of the group's batch (all-gather order, ``[ranks * b]``), the same on every rank:
    ``loss`` the InfoNCE loss, ``consistency`` CO2's symmetric KL (None without CO2); ``keys`` the
    group's keys ``[ranks * b, D]`` in that order, as the all-gather brought them (no autograd): what the
    queue takes after the step, with no collective of its own."""

    loss: torch.Tensor
    consistency: torch.Tensor | None = None
    keys: torch.Tensor | None = None


def queue_infonce(query: torch.Tensor, key: torch.Tensor, queue_keys: torch.Tensor, settings: KernelSettings,
                  group: Group, consistency_temperature: float | None = None, compiled: bool = True,
                  timer: CommTimer | None = None, feature_grad_scale: int = 1) -> QueueLoss:
    """InfoNCE (and CO2's term when ``consistency_temperature`` is given) of this rank's queries.

    Args:
        query: ``[b, D]`` this rank's L2-normalised queries, with autograd.
        key: ``[b, D]`` their L2-normalised positive keys (MoCo detaches them; a key with autograd
            gets the gradient of the loss through ``l_pos`` and, with CO2, through P).
        queue_keys: ``[K_local, D]`` this rank's slots of the queue (``KeyQueue.keys``), unit rows
            without autograd: no row gradient is computed.
        settings: the kernel's (``temperature``: tau, 0.2 in MoCo v2; ``chunk_size``: queue slots
            scored at once: with ``logits_cache_bytes`` 0, at most ``chunk_size x batch`` logits exist).
        group: the ranks that split the queue (None: this rank holds all of it).
        consistency_temperature: CO2's tau_con (0.05 in MoCo v2); None: no CO2 term.
        compiled: CO2's chunk math compiled with inductor (False: eager, same numbers).
        feature_grad_scale: what the queries' (and keys') gradient is multiplied by, as in
            ``trainer.classifier.head.CosineHead``: the group size when backbone gradients are then
            averaged over every rank.

    The gradient reaching ``query`` is that of the returned values as they are used: each rank's
    backward gives its own queries the whole group's gradient (the all-gather's backward sums the
    ranks' shares).
    """
    ranks, local = group_size(group), query.shape[0]
    if key.shape != query.shape:
        raise ValueError(f"queries {tuple(query.shape)} and keys {tuple(key.shape)} must pair up one to one")
    # One all-gather of every rank's [queries; keys]: [ranks, 2, b] rows, the layout CO2's term pairs
    # its two views by.
    both = all_gather_rows_with_grad(scale_grad(torch.cat([query, key]), feature_grad_scale), group, timer)
    by_view = both.view(ranks, 2, local, -1)
    # In fp32 whatever the features' dtype, like the kernel's own logits.
    positive = (by_view[:, QUERY].float() * by_view[:, KEY].float()).sum(dim=2) / settings.temperature  # [ranks, b]
    keys = by_view[:, KEY].detach().reshape(ranks * local, -1)
    if consistency_temperature is None:
        queries = by_view[:, QUERY].reshape(ranks * local, -1)
        no_rows, weights = _positive_only_targets(queries.shape[0], query.device)
        loss = sharded_cosine_ce(queries, queue_keys, no_rows, weights, settings, group, timer,
                                 positive_logits=positive.reshape(-1))
        return QueueLoss(loss, keys=keys)

    # The keys' columns take the same positive: their cross-entropy is finite, and dropped below.
    positive_columns = positive[:, None, :].expand(ranks, 2, local).reshape(-1)
    no_rows, weights = _positive_only_targets(both.shape[0], query.device)
    term = ConsistencyTerm(ConsistencySettings(consistency_temperature, views=2, global_views=2, compiled=compiled))
    loss, values = sharded_cosine_ce_with_term(both, queue_keys, no_rows, weights, settings, term, group, timer,
                                               positive_logits=positive_columns)
    # A column's term is its pair's L_con, in both columns of the pair: the queries' is the term.
    return QueueLoss(_queries_of(loss, ranks, local), _queries_of(values, ranks, local), keys)


def _positive_only_targets(batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """No target among the rows, the positive the only one (weight 1)."""
    return torch.empty(batch, 0, dtype=torch.int64, device=device), torch.ones(batch, 1, device=device)


def _queries_of(columns: torch.Tensor, ranks: int, local: int) -> torch.Tensor:
    """The queries' ``[ranks * b]`` of the kernel's ``[ranks, 2, b]`` columns."""
    return columns.view(ranks, 2, local)[:, QUERY].reshape(-1)
