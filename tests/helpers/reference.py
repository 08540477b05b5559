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


def reference_loss(features, weight, instance_ids, hard_negative_ids, alpha, temperature, form, unit_features=False):
    """Mean over the batch of Eq. 3 (``form='paper'``) or of -sum y log p (``'soft_target'``).
    ``unit_features``: the features are the classifier's (already normalised) input, used as given."""
    x = features.double() if unit_features else F.normalize(features.double(), dim=1)
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


def reference_grads(features, weight, instance_ids, hard_negative_ids, alpha, temperature, form, unit_features=False):
    """``(loss, dL/dfeatures, dL/dweight)`` of ``reference_loss`` in float64."""
    features = features.detach().double().requires_grad_()
    weight = weight.detach().double().requires_grad_()
    loss = reference_loss(features, weight, instance_ids, hard_negative_ids, alpha, temperature, form, unit_features)
    loss.backward()
    return loss.detach(), features.grad, weight.grad


def random_hard_negatives(instance_ids, num_classes, top_k, generator):
    """K distinct ids per row, never the row's own id."""
    rows = []
    for own in instance_ids.tolist():
        others = torch.randperm(num_classes - 1, generator=generator)[:top_k]
        rows.append(others + (others >= own))
    return torch.stack(rows)


def reference_co2_pairs(global_features, weight, instance_ids, temperature):
    """CO2's ``1/2 (KL(P||Q) + KL(Q||P))`` per pair of global views and image, ``[pairs, n]`` float64.

    ``global_features [G, n, D]``; P and Q are ``torch.softmax`` over the N - 1 rows other than the
    image's own (all of ``weight``), at ``temperature``; pairs in ``itertools.combinations`` order."""
    views, n, _ = global_features.shape
    num_rows = weight.shape[0]
    w = F.normalize(weight.double(), dim=1)
    others = torch.stack(
        [torch.cat([torch.arange(own), torch.arange(own + 1, num_rows)]) for own in instance_ids.tolist()]
    )
    log_probs = []
    for view in range(views):
        logits = F.normalize(global_features[view].double(), dim=1) @ w.t() / temperature
        log_probs.append(torch.log(torch.softmax(logits.gather(1, others), dim=1)))
    pairs = []
    for a in range(views):
        for b in range(a + 1, views):
            kl_pq = F.kl_div(log_probs[b], log_probs[a], reduction="none", log_target=True).sum(dim=1)
            kl_qp = F.kl_div(log_probs[a], log_probs[b], reduction="none", log_target=True).sum(dim=1)
            pairs.append(0.5 * (kl_pq + kl_qp))
    return torch.stack(pairs)


def reference_co2_per_view(global_features, weight, instance_ids, temperature):
    """``[G, n]``: each global view's mean of the pair terms it takes part in."""
    views = global_features.shape[0]
    pair_terms = reference_co2_pairs(global_features, weight, instance_ids, temperature)
    per_view = torch.zeros(views, global_features.shape[1], dtype=torch.float64)
    pair = 0
    for a in range(views):
        for b in range(a + 1, views):
            per_view[a] += pair_terms[pair] / (views - 1)
            per_view[b] += pair_terms[pair] / (views - 1)
            pair += 1
    return per_view
