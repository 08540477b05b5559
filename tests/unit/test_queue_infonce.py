"""MoCo's InfoNCE over a queue scored by the sharded kernel, on one process: loss and gradients against
``F.cross_entropy`` on the full float64 ``[B, 1 + K]`` logits, CO2's term on the queue against the
float64 symmetric KL, and a queue that gets no gradient and costs no row-gradient matmul."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.moco_reference import reference_infonce
from trainer.classifier.kernel.chunk_workspace import ChunkWorkspace
from trainer.classifier.kernel.chunked import KernelSettings, sharded_cosine_ce
from trainer.objectives.moco.queue_loss import queue_infonce

QUEUE, DIM, BATCH, CHUNK = 23, 8, 6, 5  # 23 slots in chunks of 5: a shorter last chunk
TAU, TAU_CON, ALPHA = 0.2, 0.05, 0.3  # MoCo v2's temperatures and CO2's weight on it


def _problem(seed: int):
    generator = torch.Generator().manual_seed(seed)
    query = F.normalize(torch.randn(BATCH, DIM, generator=generator), dim=1)
    key = F.normalize(query + 0.5 * torch.randn(BATCH, DIM, generator=generator), dim=1)  # near its query
    queue = F.normalize(torch.randn(QUEUE, DIM, generator=generator), dim=1)
    return query, key, queue


@pytest.mark.parametrize("form", ["paper", "soft_target"])
@pytest.mark.parametrize("key_has_grad", [False, True])
def test_infonce_matches_cross_entropy_on_the_full_logits(form, key_has_grad, monkeypatch):
    query, key, queue = _problem(1)
    rows_per_pass = []
    original = ChunkWorkspace.cosine_logits

    def recorded(self, features, weight_hat, out, shift=None):
        rows_per_pass.append(out.shape[0])
        return original(self, features, weight_hat, out, shift)

    monkeypatch.setattr(ChunkWorkspace, "cosine_logits", recorded)
    q = query.clone().requires_grad_()
    k = key.clone().requires_grad_(key_has_grad)
    settings = KernelSettings(temperature=TAU, chunk_size=CHUNK, form=form)
    result = queue_infonce(q, k, queue, settings, None)
    result.loss.mean().backward()

    ref_loss, _, ref_grad_q, ref_grad_k = reference_infonce(query, key, queue, TAU)
    torch.testing.assert_close(result.loss.mean().double(), ref_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(q.grad.double(), ref_grad_q, atol=1e-6, rtol=1e-5)
    if key_has_grad:
        torch.testing.assert_close(k.grad.double(), ref_grad_k, atol=1e-6, rtol=1e-5)
    assert result.consistency is None
    # The queue's logits exist one chunk at a time: never more than CHUNK rows of them.
    assert rows_per_pass and max(rows_per_pass) == CHUNK


def test_a_queue_without_grad_costs_no_row_gradient(monkeypatch):
    def no_row_gradient(*args, **kwargs):
        raise AssertionError("the backward computed a gradient for rows that do not require one")

    monkeypatch.setattr(ChunkWorkspace, "grad_weight_rows", no_row_gradient)
    query, key, queue = _problem(2)
    q = query.clone().requires_grad_()
    queue_infonce(q, key, queue, KernelSettings(temperature=TAU, chunk_size=CHUNK), None).loss.sum().backward()
    assert q.grad is not None and q.grad.abs().sum() > 0
    assert queue.grad is None


def test_consistency_term_matches_the_symmetric_kl_over_the_queue():
    query, key, queue = _problem(3)
    q = query.clone().requires_grad_()
    settings = KernelSettings(temperature=TAU, chunk_size=CHUNK)
    # Eager chunk math: the code inductor compiles (test_co2_kernel holds the compiled to it).
    result = queue_infonce(q, key, queue, settings, None, consistency_temperature=TAU_CON, compiled=False)
    (result.loss.mean() + ALPHA * result.consistency.mean()).backward()

    ref_loss, ref_term, ref_grad_q, _ = reference_infonce(query, key, queue, TAU, TAU_CON, ALPHA)
    assert ref_term > 1e-2  # the term is not zero: the comparison means something
    torch.testing.assert_close(result.loss.mean().double(), ref_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(result.consistency.mean().double(), ref_term, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(q.grad.double(), ref_grad_q, atol=1e-5, rtol=1e-4)


def test_target_weights_must_cover_the_positive():
    query, _, queue = _problem(4)
    no_rows = torch.empty(BATCH, 0, dtype=torch.int64)
    with pytest.raises(ValueError, match="target_weights has 0 columns for 0 target rows and the positive: give 1"):
        sharded_cosine_ce(query, queue, no_rows, torch.ones(BATCH, 0), KernelSettings(temperature=TAU), None,
                          positive_logits=torch.zeros(BATCH))
    with pytest.raises(ValueError, match=r"positive_logits must be a \[B\] tensor"):
        sharded_cosine_ce(query, queue, no_rows, torch.ones(BATCH, 1), KernelSettings(temperature=TAU), None,
                          positive_logits=torch.zeros(BATCH, 1))
