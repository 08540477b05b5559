"""The chunked kernel on one rank against the float64 reference: every row subset, cache on and off."""

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.reference import random_hard_negatives, reference_grads
from trainer.classifier.in_backward_sgd import InBackwardSGD
from trainer.classifier.kernel.chunk_workspace import ChunkWorkspace
from trainer.classifier.kernel.chunked import KernelSettings, sharded_cosine_ce

NUM_ROWS, DIM, BATCH, TOP_K, TAU = 41, 8, 11, 5, 0.15
WHOLE_CACHE = 1 << 20


def subset_rows(kind):
    """The local rows a subset scores, as a kernel argument and as an index of W."""
    if kind == "all":
        return None, torch.arange(NUM_ROWS)
    if kind == "window":
        return slice(7, 36), torch.arange(7, 36)
    sampled = torch.randperm(NUM_ROWS, generator=torch.Generator().manual_seed(3))[:23]
    return sampled, sampled


def problem(num_scored, alpha, seed=0):
    """Features, weight, and targets given as positions among ``num_scored`` scored rows."""
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(BATCH, DIM, generator=generator)
    weight = torch.randn(NUM_ROWS, DIM, generator=generator)
    ids = torch.randint(0, num_scored, (BATCH,), generator=generator)
    hard = random_hard_negatives(ids, num_scored, TOP_K, generator) if alpha > 0 else None
    targets = ids[:, None] if hard is None else torch.cat([ids[:, None], hard], dim=1)
    weights = torch.tensor([[1.0]]) if hard is None else torch.tensor([[1 - alpha] + [alpha / TOP_K] * TOP_K])
    return features, weight, ids, hard, targets, weights.expand(BATCH, -1)


def run_kernel(features, weight, targets, weights, settings, rows=None, update=None, per_sample_scale=None):
    """``(mean loss, dL/dfeatures, dL/dweight)`` of the kernel behind ``F.normalize``, as the module calls it."""
    features = features.clone().requires_grad_()
    weight = torch.nn.Parameter(weight.clone())
    per_sample = sharded_cosine_ce(F.normalize(features, dim=1), weight, targets, weights, settings, None,
                                   rows=rows, update_in_backward=update)
    scale = torch.full((BATCH,), 1.0 / BATCH) if per_sample_scale is None else per_sample_scale
    (per_sample * scale).sum().backward()
    return (per_sample * scale).sum().detach(), features.grad, weight.grad


@pytest.mark.parametrize("cache_bytes", [0, WHOLE_CACHE])
@pytest.mark.parametrize("rows_kind", ["all", "window", "sampled"])
@pytest.mark.parametrize("form", ["paper", "soft_target"])
@pytest.mark.parametrize("alpha", [0.0, 0.2])
@pytest.mark.parametrize("chunk_size", [1, 6, 64])  # 6 divides none of the subsets
def test_loss_and_grads_match_reference(cache_bytes, rows_kind, form, alpha, chunk_size):
    rows, row_index = subset_rows(rows_kind)
    features, weight, ids, hard, targets, weights = problem(row_index.numel(), alpha)
    settings = KernelSettings(temperature=TAU, chunk_size=chunk_size, form=form, logits_cache_bytes=cache_bytes)
    loss, grad_x, grad_w = run_kernel(features, weight, targets, weights, settings, rows)

    ref_loss, ref_grad_x, ref_grad_scored = reference_grads(features, weight[row_index], ids, hard, alpha, TAU, form)
    ref_grad_w = torch.zeros(NUM_ROWS, DIM, dtype=torch.float64).index_add_(0, row_index, ref_grad_scored)
    torch.testing.assert_close(loss.double(), ref_loss, atol=1e-6, rtol=1e-6)  # a few fp32 ulps of a loss ~6
    torch.testing.assert_close(grad_x.double(), ref_grad_x, atol=1e-6, rtol=0)
    torch.testing.assert_close(grad_w.double(), ref_grad_w, atol=1e-6, rtol=0)


@pytest.mark.parametrize("cache_bytes", [0, WHOLE_CACHE])
def test_padding_samples_contribute_exactly_nothing(cache_bytes):
    """Samples whose loss gradient is 0 (padding) leave zero feature gradient and the weight
    gradient of the valid samples alone."""
    features, weight, ids, hard, targets, weights = problem(NUM_ROWS, 0.2)
    valid = torch.arange(BATCH) % 3 != 0
    settings = KernelSettings(temperature=TAU, chunk_size=6, logits_cache_bytes=cache_bytes)
    _, grad_x, grad_w = run_kernel(features, weight, targets, weights, settings,
                                   per_sample_scale=valid.float() / int(valid.sum()))

    assert torch.equal(grad_x[~valid], torch.zeros_like(grad_x[~valid]))
    _, ref_grad_x, ref_grad_w = reference_grads(features[valid], weight, ids[valid], hard[valid], 0.2, TAU, "paper")
    torch.testing.assert_close(grad_x[valid].double(), ref_grad_x, atol=1e-6, rtol=0)
    torch.testing.assert_close(grad_w.double(), ref_grad_w, atol=1e-6, rtol=0)


@pytest.mark.parametrize("rows_kind", ["window", "sampled"])
@pytest.mark.parametrize("cache_bytes", [0, WHOLE_CACHE])
def test_in_backward_sgd_updates_only_the_scored_rows_like_torch_sgd(rows_kind, cache_bytes):
    rows, row_index = subset_rows(rows_kind)
    features, weight, ids, hard, targets, weights = problem(row_index.numel(), 0.2, seed=1)
    hyper = dict(lr=0.5, momentum=0.9, weight_decay=1e-2)
    parameter = torch.nn.Parameter(weight.clone())
    update = InBackwardSGD(parameter, **hyper)
    settings = KernelSettings(temperature=TAU, chunk_size=4, logits_cache_bytes=cache_bytes)
    for _ in range(2):  # the second step exercises the momentum buffer
        per_sample = sharded_cosine_ce(F.normalize(features, dim=1), parameter, targets, weights, settings, None,
                                       rows=rows, update_in_backward=update)
        per_sample.mean().backward()
    assert parameter.grad is None, "the full gradient of W must never exist"

    # torch.optim.SGD on the scored rows, driven by the float64 reference gradient.
    expected = torch.nn.Parameter(weight[row_index].double())
    sgd = torch.optim.SGD([expected], **hyper)
    for _ in range(2):
        _, _, expected.grad = reference_grads(features, expected, ids, hard, 0.2, TAU, "paper")
        sgd.step()
    untouched = torch.ones(NUM_ROWS, dtype=torch.bool).index_fill_(0, row_index, False)
    assert torch.equal(parameter.detach()[untouched], weight[untouched])
    torch.testing.assert_close(parameter.detach()[row_index].double(), expected.detach(), atol=1e-6, rtol=0)


def test_cache_is_used_only_when_it_fits(monkeypatch):
    """A budget one byte short of ``B * rows * 4`` recomputes the logits; both give the same numbers."""
    features, weight, _, _, targets, weights = problem(NUM_ROWS, 0.0)
    fits, short = BATCH * NUM_ROWS * 4, BATCH * NUM_ROWS * 4 - 1
    logit_matmuls = 0
    original = ChunkWorkspace.cosine_logits

    def counted(*args, **kwargs):
        nonlocal logit_matmuls
        logit_matmuls += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(ChunkWorkspace, "cosine_logits", counted)
    results = {}
    for budget in (fits, short):
        logit_matmuls = 0
        results[budget] = run_kernel(features, weight, targets, weights,
                                     KernelSettings(chunk_size=41, logits_cache_bytes=budget))
        results[budget] += (logit_matmuls,)
    assert results[fits][3] == 1 and results[short][3] == 2  # forward (+ the backward's recomputation)
    for cached, recomputed in zip(results[fits][:3], results[short][:3]):
        torch.testing.assert_close(cached, recomputed, atol=1e-6, rtol=0)


def test_settings_reject_what_the_kernel_cannot_compute_exactly():
    with pytest.raises(ValueError, match="tau >= 0.02"):
        KernelSettings(temperature=0.01)
    with pytest.raises(ValueError, match="'label_smoothing' is not a valid SmoothingForm"):
        KernelSettings(form="label_smoothing")


@pytest.mark.parametrize("cache_bytes", [0, WHOLE_CACHE])
def test_bfloat16_features_use_the_same_paths(cache_bytes):
    """Half-precision matmuls, fp32 logits, cache and loss: agreement to bf16's ~3 digits."""
    features, weight, ids, hard, targets, weights = problem(NUM_ROWS, 0.2)
    settings = KernelSettings(temperature=TAU, chunk_size=6, logits_cache_bytes=cache_bytes)
    loss, grad_x, grad_w = run_kernel(features.bfloat16(), weight, targets, weights, settings)
    ref_loss, ref_grad_x, ref_grad_w = reference_grads(features, weight, ids, hard, 0.2, TAU, "paper")
    assert loss.dtype == torch.float32 and grad_x.dtype == torch.bfloat16 and grad_w.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref_loss, atol=2e-2, rtol=0)
    torch.testing.assert_close(grad_x.double(), ref_grad_x, atol=2e-2, rtol=5e-2)
    torch.testing.assert_close(grad_w.double(), ref_grad_w, atol=2e-2, rtol=5e-2)


@pytest.mark.parametrize("cache_bytes", [0, WHOLE_CACHE])
@pytest.mark.parametrize("form", ["paper", "soft_target"])
def test_negative_and_zero_loss_weights_match_reference(cache_bytes, form):
    """A loss backpropagated with per-sample weights of either sign (and zeros, like padding):
    the recompute path carries the signs without a host sync, and must still be exact."""
    features, weight, ids, hard, targets, weights = problem(NUM_ROWS, 0.2, seed=5)
    sample_weights = torch.linspace(-1.0, 1.0, BATCH)  # negative, one exact zero, positive
    settings = KernelSettings(temperature=TAU, chunk_size=6, form=form, logits_cache_bytes=cache_bytes)
    loss, grad_x, grad_w = run_kernel(features, weight, targets, weights, settings, per_sample_scale=sample_weights)

    x = features.double().requires_grad_()
    w = weight.double().requires_grad_()
    per_sample = torch.stack([reference_grads(x[i : i + 1], w, ids[i : i + 1], hard[i : i + 1], 0.2, TAU, form)[0]
                              for i in range(BATCH)])  # detached per-sample losses, for the loss value
    expected_loss = (per_sample * sample_weights.double()).sum()
    expected_x = torch.zeros_like(x)
    expected_w = torch.zeros_like(w)
    for i in range(BATCH):
        _, gx, gw = reference_grads(x[i : i + 1], w, ids[i : i + 1], hard[i : i + 1], 0.2, TAU, form)
        expected_x[i] = gx[0] * sample_weights[i]
        expected_w += gw * sample_weights[i]
    torch.testing.assert_close(loss.double(), expected_loss, atol=1e-5, rtol=0)
    torch.testing.assert_close(grad_x.double(), expected_x, atol=1e-5, rtol=0)
    torch.testing.assert_close(grad_w.double(), expected_w, atol=1e-5, rtol=0)
