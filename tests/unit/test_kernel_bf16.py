"""The chunked kernel with bf16 features (what a bf16 DeepSpeed engine feeds it) against the
float64 reference on the same bf16 input values.

The tolerances are the GPU's arithmetic: bf16 operands (the features as given, the unit weight rows
and dL/dz rounded once to bf16, 2^-9 relative), fp32 accumulation and fp32 output
(``trainer.classifier.kernel.half_matmul`` emulates exactly that on CPUs).  Measured worst cases over the
8 cases below: loss 1.3e-4 absolute (on a loss ~2.4), dL/dW 3.6e-3 and dL/dx 6.5e-3 of the largest
reference entry (dL/dx comes back as bf16, itself 2^-9 = 2e-3 relative); the tolerances allow
~1.5x that.  Logits rounded to bf16 before the fp32 copy, and the features rounded twice (the bug
this pins) gave 3.3e-4, 7.7e-3 and 1.1e-2: trained rows make the target logits large (cos ~0.9 at
tau 0.1 is 13 in base 2), where bf16's spacing is 0.06.
"""

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.reference import random_hard_negatives, reference_grads
from trainer.classifier.kernel.chunked import KernelSettings, sharded_cosine_ce

NUM_ROWS, DIM, BATCH, TOP_K, TAU, ALPHA = 300, 128, 32, 5, 0.1, 0.2
LOSS_ATOL, GRAD_W_REL, GRAD_X_REL = 2e-4, 5e-3, 9e-3


def trained_problem(rows_kind, seed=0):
    """Unit bf16 features and rows of which each sample's own is aligned with it (cos ~0.9), as
    after some training: the large logits are where bf16 rounding hurts."""
    generator = torch.Generator().manual_seed(seed)
    features = F.normalize(torch.randn(BATCH, DIM, generator=generator), dim=1).to(torch.bfloat16)
    weight = torch.randn(NUM_ROWS, DIM, generator=generator)
    scored = torch.arange(NUM_ROWS) if rows_kind == "all" else torch.randperm(NUM_ROWS, generator=generator)[:170]
    ids = torch.randint(0, scored.numel(), (BATCH,), generator=generator)
    weight[scored[ids]] = features.float() * 3 + 0.3 * torch.randn(BATCH, DIM, generator=generator)
    hard = random_hard_negatives(ids, scored.numel(), TOP_K, generator)
    return features, weight, scored, ids, hard


@pytest.mark.parametrize("cache_bytes", [0, 1 << 22])
@pytest.mark.parametrize("rows_kind", ["all", "sampled"])
@pytest.mark.parametrize("form", ["paper", "soft_target"])
def test_bf16_features_match_float64_reference(cache_bytes, rows_kind, form):
    features, weight, scored, ids, hard = trained_problem(rows_kind)
    targets = torch.cat([ids[:, None], hard], dim=1)
    weights = torch.tensor([[1 - ALPHA] + [ALPHA / TOP_K] * TOP_K]).expand(BATCH, -1)
    settings = KernelSettings(temperature=TAU, chunk_size=64, form=form, logits_cache_bytes=cache_bytes)
    x = features.clone().requires_grad_()
    w = torch.nn.Parameter(weight.clone())
    loss = sharded_cosine_ce(x, w, targets, weights, settings, None,
                             rows=None if rows_kind == "all" else scored).mean()
    loss.backward()
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32

    ref_loss, ref_grad_x, ref_grad_scored = reference_grads(features, weight[scored], ids, hard, ALPHA, TAU, form,
                                                            unit_features=True)
    ref_grad_w = torch.zeros(NUM_ROWS, DIM, dtype=torch.float64).index_add_(0, scored, ref_grad_scored)
    torch.testing.assert_close(loss.double(), ref_loss, atol=LOSS_ATOL, rtol=0)
    torch.testing.assert_close(w.grad.double(), ref_grad_w, atol=GRAD_W_REL * ref_grad_w.abs().max().item(), rtol=0)
    torch.testing.assert_close(x.grad.double(), ref_grad_x, atol=GRAD_X_REL * ref_grad_x.abs().max().item(), rtol=0)
