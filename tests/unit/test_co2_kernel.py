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


def _term_and_grads(compiled: bool, kernel_temperature: float, views: list[str]):
    """Loss, term and both gradients of one step with the term's chunk math compiled or eager."""
    generator = torch.Generator().manual_seed(4)
    images, rows = 3, 11  # chunk 4 does not divide the 11 rows
    features = F.normalize(torch.randn(len(views) * images, DIM, generator=generator), dim=1).requires_grad_()
    weight = torch.randn(rows, DIM, generator=generator).requires_grad_()
    targets = torch.tensor([7, 0, 3]).repeat(len(views))[:, None]
    settings = KernelSettings(temperature=kernel_temperature, chunk_size=4)
    consistency = settings_for_views(0.05, views, compiled=compiled)
    loss, term = sharded_cosine_ce_with_consistency(features, weight, targets, torch.ones(len(targets), 1), settings,
                                                    consistency, None)
    upstream = torch.rand(len(targets), generator=generator)
    (loss.sum() + (term * upstream).sum()).backward()
    return loss, term, features.grad, weight.grad


@pytest.mark.parametrize("kernel_temperature", [0.15, 0.12])  # tau / tau_con = 3 (the power path), 2.4 (exp2)
def test_compiled_chunk_math_equals_the_same_code_run_eagerly(kernel_temperature):
    views = ["global", "global", "small"]  # a small crop: its columns take the kernel's part only
    eager = _term_and_grads(False, kernel_temperature, views)
    compiled = _term_and_grads(True, kernel_temperature, views)
    from trainer.classifier import consistency

    assert eager[1].abs().max() > 1e-3  # the term is not zero
    assert not consistency._fused_add_chunk_sums.fell_back  # the backward ran the CPU kernel:
    assert consistency.consistency_grad_kernel() is not None
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_a_failed_compile_runs_the_function_eagerly_with_a_warning(monkeypatch, caplog):
    from trainer.classifier import fusion

    def broken_compile(graph, example_inputs):
        def compiled(*args):
            raise RuntimeError("no C++ compiler found")
        return compiled

    monkeypatch.setattr(fusion.torch._inductor, "compile", broken_compile)
    doubled = fusion.fused(lambda x: x * 2)
    with caplog.at_level("WARNING", logger=fusion.__name__):
        assert torch.equal(doubled(torch.ones(3)), torch.full((3,), 2.0))
    assert "no C++ compiler found" in caplog.text and "eagerly" in caplog.text
    caplog.clear()
    assert torch.equal(doubled(torch.ones(2)), torch.full((2,), 2.0))  # eager from then on, warned once
    assert caplog.text == ""


@pytest.mark.parametrize("kernel_temperature, views, global_views, ranks, local", [
    (0.15, 2, 2, 2, 16),  # tau / tau_con = 3: exp(s) = exp(z) ** 3; whole vectors only
    (0.2, 2, 2, 3, 9),  # power 4, a partial vector per rank
    (0.12, 3, 2, 1, 5),  # tau / tau_con = 2.4: a second exp2; a small crop beside two global views
    (0.15, 4, 3, 2, 11),  # three global views (three pairs) and a small crop
    (0.1, 4, 4, 1, 8),  # four global views (six pairs), power 2
])
def test_cpu_kernel_writes_the_reference_gradient_over_the_logits(kernel_temperature, views, global_views, ranks,
                                                                   local):
    from trainer.classifier.consistency import _ChunkMath, _grad_logits
    from trainer.classifier.cpu_kernels import consistency_grad_kernel

    kernel = consistency_grad_kernel()
    assert kernel is not None  # a C++ compiler is part of the test environment, as inductor needs one
    generator = torch.Generator().manual_seed(5)
    settings = ConsistencySettings(0.05, views, global_views)
    math_ = _ChunkMath.of(settings, kernel_temperature, ranks * views * local, ranks)
    rows, columns = 1100, ranks * views * local  # more rows than one task of the kernel's parallel_for
    logits = torch.randn(rows, columns, generator=generator) * 4
    shift = torch.randn(columns, generator=generator) + 3
    own = torch.full((columns,), -1.0)  # every third column has its own row in the chunk
    own[::3] = torch.randint(0, rows, (len(own[::3]),), generator=generator).float()
    own = own.view(math_.grid)
    coefficients = torch.randn(3, len(settings.pairs), 2, ranks, local, generator=generator)
    shift[0], coefficients[..., 0, 0] = float("inf"), 0.0  # column 0 is padding: its gradient is exactly 0
    want = _grad_logits(logits, shift, torch.exp2(-shift), own, coefficients, math_)
    written = logits.clone()
    got = kernel(written, shift, torch.exp2(-shift), own, coefficients, ranks, views, global_views, math_.power or 0,
                 math_.ratio)
    assert got.data_ptr() == written.data_ptr()  # in place
    assert torch.all(got[:, 0] == 0) and want.abs().max() > 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())


def test_a_failed_cpu_kernel_build_falls_back_to_inductor_with_a_warning(monkeypatch, caplog):
    from torch.utils import cpp_extension

    from trainer.classifier import consistency, cpu_kernels

    def broken_load(**kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp_extension, "load", broken_load)
    cpu_kernels.consistency_grad_kernel.cache_clear()
    try:
        with caplog.at_level("WARNING", logger=cpu_kernels.__name__):
            assert cpu_kernels.consistency_grad_kernel() is None
        assert "Ninja is required" in caplog.text and "inductor" in caplog.text
        views = ["global", "global"]
        for got, want in zip(_term_and_grads(True, 0.15, views), _term_and_grads(False, 0.15, views)):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        assert not consistency._fused_grad_logits.fell_back and consistency._fused_grad_logits._kernels
    finally:
        cpu_kernels.consistency_grad_kernel.cache_clear()
