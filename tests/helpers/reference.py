"""Single-process reference losses written straight from the paper's equations.

Everything is computed on the full ``[B, N]`` cosine logits in float64 with plain autograd; it
shares no code with ``trainer.classifier`` so it can catch mistakes there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def smoothing_targets(instance_ids, hard_negative_ids, num_classes, alpha):
    """Dense ``y [B, N]``: 1 - alpha on the instance, alpha / K on each hard negative."""
    batch = instance_ids.shape[0]
    y = torch.zeros(batch, num_classes, dtype=torch.float64)
    if hard_negative_ids is None or alpha == 0:
        y[torch.arange(batch), instance_ids] = 1.0
        return y
    top_k = hard_negative_ids.shape[1]
    y[torch.arange(batch), instance_ids] = 1.0 - alpha
    y.scatter_add_(1, hard_negative_ids, torch.full(hard_negative_ids.shape, alpha / top_k, dtype=torch.float64))
    return y


def reference_loss(features, weight, instance_ids, hard_negative_ids, alpha, temperature, form):
    """Mean over the batch of Eq. 3 (``form='paper'``) or of -sum y log p (``'soft_target'``)."""
    x = F.normalize(features.double(), dim=1)
    w = F.normalize(weight.double(), dim=1)
    logits = x @ w.t() / temperature
    y = smoothing_targets(instance_ids, hard_negative_ids, weight.shape[0], alpha)
    log_z = torch.logsumexp(logits, dim=1)
    if form == "paper":
        # -log( sum_j y_ij exp(z_ij) / sum_j exp(z_ij) )
        per_sample = log_z - torch.logsumexp(logits + torch.log(y), dim=1)
    else:
        per_sample = -(y * torch.log_softmax(logits, dim=1)).sum(dim=1)
    return per_sample.mean()


def reference_grads(features, weight, instance_ids, hard_negative_ids, alpha, temperature, form):
    """``(loss, dL/dfeatures, dL/dweight)`` of ``reference_loss`` in float64."""
    features = features.detach().double().requires_grad_()
    weight = weight.detach().double().requires_grad_()
    loss = reference_loss(features, weight, instance_ids, hard_negative_ids, alpha, temperature, form)
    loss.backward()
    return loss.detach(), features.grad, weight.grad


def random_hard_negatives(instance_ids, num_classes, top_k, generator):
    """K distinct ids per row, never the row's own id."""
    rows = []
    for own in instance_ids.tolist():
        others = torch.randperm(num_classes - 1, generator=generator)[:top_k]
        rows.append(others + (others >= own))
    return torch.stack(rows)
