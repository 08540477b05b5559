"""CO2's fused term on one process: its gradient against central finite differences, alpha = 0 is
today's loss exactly, and the settings refuse what cannot work."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainer.classifier import ClassifierConfig, ShardedCosineClassifier
from trainer.classifier.consistency import ConsistencySettings, settings_for_views
from trainer.classifier.kernel import KernelSettings, sharded_cosine_ce, sharded_cosine_ce_with_consistency
from trainer.objectives import InstanceConfig, PicConfig
from trainer.parallel.dims import single_process_dims

NUM_ROWS, DIM, IMAGES = 6, 3, 2


def _term(features, weight, ids, settings, consistency, upstream):
    targets = ids.repeat(2)[:, None]
    _, term = sharded_cosine_ce_with_consistency(features, weight, targets, torch.ones(2 * IMAGES, 1), settings,
                                                 consistency, None)
    return (term * upstream).sum()


def test_fused_gradient_matches_finite_differences():
    generator = torch.Generator().manual_seed(1)
    # Mild temperatures keep the third derivatives small, so central differences in fp32 are accurate.
    settings = KernelSettings(temperature=0.5, chunk_size=4)
    consistency = ConsistencySettings(temperature=0.4, views=2, global_views=2)
    features = F.normalize(torch.randn(2 * IMAGES, DIM, generator=generator), dim=1).requires_grad_()
    weight = torch.randn(NUM_ROWS, DIM, generator=generator).requires_grad_()
    ids = torch.tensor([1, 4])
    upstream = torch.rand(2 * IMAGES, generator=generator)
    _term(features, weight, ids, settings, consistency, upstream).backward()

    step = 1e-2
    for tensor in (features, weight):
        numeric = torch.zeros_like(tensor)
        for index in range(tensor.numel()):
            with torch.no_grad():
                flat = tensor.view(-1)
                flat[index] += step
                plus = _term(features, weight, ids, settings, consistency, upstream)
                flat[index] -= 2 * step
                minus = _term(features, weight, ids, settings, consistency, upstream)
                flat[index] += step
            numeric.view(-1)[index] = (plus - minus) / (2 * step)
        assert numeric.abs().max() > 1e-2  # the term moves: the comparison is not between zeros
        torch.testing.assert_close(tensor.grad, numeric, atol=2e-4, rtol=2e-3)


def _classifier_step(co2_alpha: float | None):
    overrides = {} if co2_alpha is None else {"co2_alpha": co2_alpha}
    classifier = ShardedCosineClassifier(
        ClassifierConfig(num_classes=NUM_ROWS, feature_dim=DIM, chunk_size=4, init_std=1.0, **overrides),
        single_process_dims(),
    )
    features = torch.randn(2 * IMAGES, DIM, generator=torch.Generator().manual_seed(2)).requires_grad_()
    loss = classifier(features, torch.tensor([0, 5]).repeat(2), view_kinds=["global", "global"])
    loss.backward()
    return loss, features.grad, classifier.weight.grad


def test_alpha_zero_is_exactly_todays_loss_and_gradients():
    for got, want in zip(_classifier_step(0.0), _classifier_step(None)):
        assert torch.equal(got, want)
    with_term = _classifier_step(0.3)
    assert not torch.equal(with_term[0], _classifier_step(None)[0])


def test_fused_kernel_leaves_the_instance_loss_unchanged():
    generator = torch.Generator().manual_seed(3)
    features = F.normalize(torch.randn(2 * IMAGES, DIM, generator=generator), dim=1)
    weight = torch.randn(NUM_ROWS, DIM, generator=generator)
    targets = torch.tensor([[2], [3], [2], [3]])
    settings = KernelSettings(temperature=0.15, chunk_size=4)
    results = []
    for fused in (False, True):
        x, w = features.clone().requires_grad_(), weight.clone().requires_grad_()
        if fused:
            loss, term = sharded_cosine_ce_with_consistency(x, w, targets, torch.ones(4, 1), settings,
                                                            ConsistencySettings(), None)
            (loss.sum() + 0 * term.sum()).backward()
        else:
            loss = sharded_cosine_ce(x, w, targets, torch.ones(4, 1), settings, None)
            loss.sum().backward()
        results.append((loss, x.grad, w.grad))
    assert torch.equal(results[0][0], results[1][0])
    for got, want in zip(results[1][1:], results[0][1:]):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_settings_refuse_what_cannot_work():
    with pytest.raises(ValueError, match="two global views"):
        settings_for_views(0.05, ["global", "small", "small"])
    with pytest.raises(ValueError, match="two global views"):
        settings_for_views(0.05, ["global", "small", "global"])
    assert settings_for_views(0.05, ["global", "global", "small"]) == ConsistencySettings(0.05, 3, 2)
    for config in (InstanceConfig, PicConfig):
        with pytest.raises(ValueError, match="co2_temperature=0.01 is invalid"):
            config(co2_temperature=0.01)
        with pytest.raises(ValueError, match="co2_alpha=-0.1 is invalid"):
            config(co2_alpha=-0.1)
    one_view = ShardedCosineClassifier(ClassifierConfig(num_classes=NUM_ROWS, feature_dim=DIM, co2_alpha=0.3),
                                       single_process_dims())
    with pytest.raises(ValueError, match="num_views: 2"):
        one_view(torch.randn(2, DIM), torch.tensor([0, 1]))
