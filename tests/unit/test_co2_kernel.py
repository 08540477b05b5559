"""CO2's fused term on one process: its gradient against central finite differences, alpha = 0 is
today's loss exactly, and the settings refuse what cannot work."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from data_pipeline.loading.view_layout import ViewLayout
from trainer.classifier import ClassifierConfig, ShardedCosineClassifier
from trainer.classifier.kernel.chunked import KernelSettings, sharded_cosine_ce, sharded_cosine_ce_with_term
from trainer.classifier.terms.co2 import ConsistencySettings, ConsistencyTerm
from trainer.objectives import InstanceConfig, PicConfig
from trainer.parallel.dims import single_process_dims

NUM_ROWS, DIM, IMAGES = 6, 3, 2


def _term(features, weight, ids, settings, consistency, upstream):
    targets = ids.repeat(2)[:, None]
    _, term = sharded_cosine_ce_with_term(features, weight, targets, torch.ones(2 * IMAGES, 1), settings,
                                          ConsistencyTerm(consistency), None)
    return (term * upstream).sum()


@pytest.mark.integration
def test_fused_gradient_matches_finite_differences():
    generator = torch.Generator().manual_seed(1)
    # Mild temperatures keep the third derivatives small, so central differences in fp32 are accurate.
    settings = KernelSettings(temperature=0.5, chunk_size=4)
    # The chunk math run eagerly: the same code inductor compiles, whose compiled numbers
    # test_compiled_chunk_math_equals_the_same_code_run_eagerly holds to these (a cold compile per
    # chunk shape would cost more than the 60 differences).
    consistency = ConsistencySettings(temperature=0.4, views=2, global_views=2, compiled=False)
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
        single_process_dims(), ViewLayout(("global", "global"), (32, 32)),
    )
    features = torch.randn(2 * IMAGES, DIM, generator=torch.Generator().manual_seed(2)).requires_grad_()
    loss = classifier(features, torch.tensor([0, 5]).repeat(2))
    loss.backward()
    return loss, features.grad, classifier.weight.grad


@pytest.mark.integration
def test_alpha_zero_is_exactly_todays_loss_and_gradients(monkeypatch):
    from trainer.classifier.terms import TERMS

    for got, want in zip(_classifier_step(0.0), _classifier_step(None)):
        assert torch.equal(got, want)
    # The term only has to move the loss here: its chunk math runs eagerly, not compiled (the
    # compiled math equals the eager one: test_compiled_chunk_math_equals_the_same_code_run_eagerly).
    monkeypatch.setitem(TERMS, "co2", lambda settings, views: ConsistencyTerm.for_views(
        settings.co2_temperature, settings.co2_alpha, views.kinds, compiled=False))
    with_term = _classifier_step(0.3)
    assert not torch.equal(with_term[0], _classifier_step(None)[0])


@pytest.mark.integration
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
            loss, term = sharded_cosine_ce_with_term(x, w, targets, torch.ones(4, 1), settings,
                                                     ConsistencyTerm(ConsistencySettings()), None)
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
        ConsistencyTerm.for_views(0.05, 0.3, ["global", "small", "small"])
    with pytest.raises(ValueError, match="two global views"):
        ConsistencyTerm.for_views(0.05, 0.3, ["global", "small", "global"])
    assert ConsistencyTerm.for_views(0.05, 0.3, ["global", "global", "small"]).settings == ConsistencySettings(
        0.05, 3, 2
    )
    for config in (InstanceConfig, PicConfig):
        with pytest.raises(ValueError, match="co2_temperature=0.01 is invalid"):
            config(co2_temperature=0.01)
        with pytest.raises(ValueError, match="co2_alpha=-0.1 is invalid"):
            config(co2_alpha=-0.1)
    with pytest.raises(ValueError, match="num_views: 2"):  # the job's layout is checked when the head is built
        ShardedCosineClassifier(
            ClassifierConfig(num_classes=NUM_ROWS, feature_dim=DIM, co2_alpha=0.3), single_process_dims()
        )


def _term_and_grads(compiled: bool, kernel_temperature: float, views: list[str], rows_vary: bool = False,
                    rows: int = 11):
    """Loss, term and both gradients of one step with the term's chunk math compiled or eager
    (``rows_vary``: its chunks padded to power-of-two row counts, as PIC's are; the default 11
    ``rows`` leave a shorter last chunk of 4)."""
    generator = torch.Generator().manual_seed(4)
    images = 3
    features = F.normalize(torch.randn(len(views) * images, DIM, generator=generator), dim=1).requires_grad_()
    weight = torch.randn(rows, DIM, generator=generator).requires_grad_()
    targets = torch.tensor([7, 0, 3]).repeat(len(views))[:, None]
    settings = KernelSettings(temperature=kernel_temperature, chunk_size=4, rows_vary=rows_vary)
    term_of_views = ConsistencyTerm.for_views(0.05, 1.0, views, compiled=compiled)
    loss, term = sharded_cosine_ce_with_term(
        features, weight, targets, torch.ones(len(targets), 1), settings, term_of_views, None
    )
    upstream = torch.rand(len(targets), generator=generator)
    (loss.sum() + (term * upstream).sum()).backward()
    return loss, term, features.grad, weight.grad


# tau / tau_con = 3 (the power path), 2.4 (exp2)
@pytest.mark.parametrize("kernel_temperature", [0.15, pytest.param(0.12, marks=pytest.mark.slow)])
@pytest.mark.integration
def test_compiled_chunk_math_equals_the_same_code_run_eagerly(kernel_temperature, capsys):
    from trainer.classifier.terms import co2_math as consistency_math

    for function in (consistency_math.fused_add_chunk_sums, consistency_math.fused_grad_logits):
        function._kernels.clear()  # compiled by an earlier test: this one must see the compiles happen
    views = ["global", "global", "small"]  # a small crop: its columns take the kernel's part only
    # 8 rows: two chunks of one shape, so each function compiles once (a cold compile costs seconds);
    # a shorter last chunk is only another signature of the same graph.
    eager = _term_and_grads(False, kernel_temperature, views, rows=8)
    compiled = _term_and_grads(True, kernel_temperature, views, rows=8)

    said = capsys.readouterr().err  # a compile is announced, not silently waited for
    compiles = [fn for fn in (consistency_math.fused_add_chunk_sums, consistency_math.fused_grad_logits) if fn._kernels]
    assert compiles and all(
        f"compiling {fn.fn.__qualname__} with inductor" in said and f"compiled {fn.fn.__qualname__} in " in said
        for fn in compiles
    ), said

    assert eager[1].abs().max() > 1e-3  # the term is not zero
    # Both functions ran compiled (inductor), not through the eager fallback.
    for function in (consistency_math.fused_add_chunk_sums, consistency_math.fused_grad_logits):
        assert not function.fell_back and function._kernels
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("views", [["global", "global"], ["global", "global", "small"]])
def test_chunks_padded_to_a_bucket_give_the_same_loss_term_and_gradients(views):
    """PIC's chunks (4 and 3 rows here) are padded to 64 rows of PAD_LOGIT so the
    fused term compiles for a few shapes; the padding adds nothing and its gradient rows are dropped."""
    from trainer.classifier.terms.co2 import bucketed_rows

    assert [bucketed_rows(rows) for rows in (1, 64, 65, 1088, 65536)] == [64, 64, 128, 2048, 65536]
    exact = _term_and_grads(False, 0.15, views)
    padded = _term_and_grads(False, 0.15, views, rows_vary=True)
    for name, a, b in zip(("loss", "term", "feature grad", "weight grad"), exact, padded):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=name)


def test_a_failed_compile_runs_the_function_eagerly_with_a_warning(monkeypatch, caplog):
    from trainer.classifier.terms import inductor_fusion as fusion

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


def _chunk_inputs(kernel_temperature, views, global_views, ranks, local):
    """Random inputs of both chunk functions for one layout, with padding and own rows in the chunk."""
    from trainer.classifier.terms.co2_math import ChunkMath

    generator = torch.Generator().manual_seed(5)
    settings = ConsistencySettings(0.05, views, global_views)
    math_ = ChunkMath.of(settings, kernel_temperature, ranks * views * local, ranks)
    rows, columns = 70, ranks * views * local
    logits = torch.randn(rows, columns, generator=generator) * 4
    shift = torch.randn(columns, generator=generator) + 3
    own = torch.full((columns,), -1.0)  # every third column has its own row in the chunk
    own[::3] = torch.randint(0, rows, (len(own[::3]),), generator=generator).float()
    own = own.view(math_.grid)
    coefficients = torch.randn(3, len(settings.pairs), 2, ranks, local, generator=generator)
    shift[0], coefficients[..., 0, 0] = float("inf"), 0.0  # column 0 is padding: its gradient is exactly 0
    sums = (
        torch.rand(columns, generator=generator),
        torch.zeros(ranks, global_views, local),
        torch.zeros(len(settings.pairs), 2, ranks, local),
    )
    return math_, (logits, shift, torch.exp2(-shift), own, coefficients), sums


def _vector_widths_here() -> list[int]:
    """Every vector width inductor can compile for on this machine, scalar (1) included (one ISA per
    width: inductor picks the first it knows of that width)."""
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    return [1, *sorted({isa.bit_width() for isa in valid_vec_isa_list()})]


# Layouts of the chunk math: two to four global views, small crops, several ranks, powers 2-4 and the
# second exp2, and local batches that leave partial vectors.
# Each layout compiles two functions per width (~10 s cold): they run in `make test-all`.
LAYOUTS = [
    pytest.param(0.15, 2, 2, 2, 16, marks=pytest.mark.slow),  # tau / tau_con = 3: exp(s) = exp(z) ** 3
    pytest.param(0.2, 2, 2, 3, 9, marks=pytest.mark.slow),  # power 4, a partial vector per rank
    pytest.param(0.12, 3, 2, 1, 5, marks=pytest.mark.slow),  # tau / tau_con = 2.4: a second exp2; a small crop
    pytest.param(0.15, 4, 3, 2, 11, marks=pytest.mark.slow),  # three global views (three pairs) and a small crop
    pytest.param(0.1, 4, 4, 1, 8, marks=pytest.mark.slow),  # four global views (six pairs), power 2
]


@pytest.mark.parametrize("kernel_temperature, views, global_views, ranks, local", LAYOUTS)
@pytest.mark.integration
def test_chunk_math_is_the_same_on_every_vector_isa_this_machine_has(
    kernel_temperature, views, global_views, ranks, local
):
    """The code a step runs does not depend on the processor: each chunk function, compiled by
    inductor for every vector width this machine offers (scalar, AVX2, AVX-512, ...; whatever its ISA
    is called), gives the eager reference's numbers.  The retired C++ kernel was named after the ISA
    and failed to build where that name held a space; a run-time build per ISA is what this guards."""
    from torch._inductor import config as inductor_config
    from torch._inductor import metrics as inductor_metrics

    from trainer.classifier.terms.co2_math import _add_chunk_sums, _grad_logits
    from trainer.classifier.terms.inductor_fusion import Fused

    math_, grad_inputs, sums = _chunk_inputs(kernel_temperature, views, global_views, ranks, local)
    logits, _, _, own, _ = grad_inputs
    want_grad = _grad_logits(*grad_inputs, math_)
    want_sums = _add_chunk_sums(*sums, logits, own, math_)
    assert want_grad.abs().max() > 1 and torch.all(want_grad[:, 0] == 0)
    for width in _vector_widths_here():
        inductor_metrics.reset()
        # No graph cache: each width is generated here, so the kernel count below is this width's.
        with inductor_config.patch({"cpp.simdlen": width, "fx_graph_cache": False}):
            grad_logits, add_chunk_sums = Fused(_grad_logits), Fused(_add_chunk_sums)  # fresh: compiled here
            got_grad = grad_logits(*grad_inputs, math_)
            got_sums = add_chunk_sums(*sums, logits, own, math_)
        assert not grad_logits.fell_back and not add_chunk_sums.fell_back, f"inductor failed at simdlen {width}"
        vector_kernels = inductor_metrics.generated_cpp_vec_kernel_count
        assert (vector_kernels > 0) == (width > 1), f"simdlen {width}: {vector_kernels} vectorised kernels"
        assert torch.all(got_grad[:, 0] == 0)
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-6 * want_grad.abs().max().item())
        for got, want in zip(got_sums, want_sums):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_nothing_is_built_with_cpp_extension_at_run_time():
    """One path for every machine: no module of ours compiles its own C++ when it runs (a name or a
    flag taken from this processor broke such a build on another).  Inductor compiles the fused
    functions, and falls back to eager PyTorch where it cannot."""
    from pathlib import Path

    def builds_cpp(path: Path) -> bool:
        if path.suffix == ".cpp":
            return True
        return path.suffix == ".py" and any(
            call in path.read_text(encoding="utf-8") for call in ("cpp_extension", "load_inline")
        )

    repo = Path(__file__).resolve().parents[2]
    offenders = [
        str(path.relative_to(repo))
        for package in ("trainer", "data_pipeline")
        for path in (repo / package).rglob("*")
        if builds_cpp(path)
    ]
    assert offenders == []


def test_both_chunk_functions_are_compiled_during_the_forward_never_inside_the_backward(monkeypatch):
    """On CUDA the backward runs on autograd's own thread, mid-step; the
    backward's fused function is compiled in the forward, for every chunk shape (11 rows in chunks
    of 4: a shorter last chunk)."""
    from trainer.classifier.terms import co2 as consistency
    from trainer.classifier.terms import co2_math as consistency_math
    from trainer.classifier.terms import inductor_fusion as fusion

    compiles = []

    def recording_compile(fn, args):
        compiles.append((fn.__name__, _term_and_grads.stage, torch._C._current_autograd_node() is not None))
        positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

        def eager(*tensors):
            full = list(args)
            for position, tensor in zip(positions, tensors):
                full[position] = tensor
            return fn(*full)

        return eager

    monkeypatch.setattr(fusion, "compile_for", recording_compile)
    monkeypatch.setattr(consistency, "fused_add_chunk_sums", fusion.Fused(consistency_math._add_chunk_sums))
    monkeypatch.setattr(consistency, "fused_grad_logits", fusion.Fused(consistency_math._grad_logits))
    original_backward = consistency.ConsistencyBackward.__init__

    def backward_starts(self, *args, **kwargs):
        _term_and_grads.stage = "backward"
        original_backward(self, *args, **kwargs)

    monkeypatch.setattr(consistency.ConsistencyBackward, "__init__", backward_starts)
    monkeypatch.setattr(_term_and_grads, "stage", "forward", raising=False)
    _term_and_grads(True, 0.15, ["global", "global", "small"])

    assert _term_and_grads.stage == "backward"  # the backward ran
    by_function = {
        name: [(stage, in_autograd) for n, stage, in_autograd in compiles if n == name]
        for name in ("_add_chunk_sums", "_grad_logits")
    }
    # Two chunk shapes each (4 rows, then 3), all compiled in the forward, outside autograd's engine.
    assert by_function == {name: [("forward", False)] * 2 for name in by_function}


def test_a_failed_compile_on_an_accelerator_is_an_error_unless_the_fallback_is_allowed(monkeypatch, caplog):
    from trainer.classifier.terms import inductor_fusion as fusion

    def broken_compile(fn, args):
        raise RuntimeError("triton not found")

    monkeypatch.setattr(fusion, "compile_for", broken_compile)
    monkeypatch.setattr(fusion, "_on_accelerator", lambda args: True)  # as for CUDA tensors
    monkeypatch.delenv(fusion.EAGER_FALLBACK_ENV, raising=False)
    doubled = fusion.fused(lambda x: x * 2)
    with pytest.raises(fusion.FusionCompileError, match=f"triton not found.*{fusion.EAGER_FALLBACK_ENV}=1"):
        doubled.prepare(torch.ones(3))
    with pytest.raises(fusion.FusionCompileError):
        doubled(torch.ones(3))
    assert not doubled.fell_back

    monkeypatch.setenv(fusion.EAGER_FALLBACK_ENV, "1")
    with caplog.at_level("WARNING", logger=fusion.__name__):
        assert torch.equal(doubled(torch.ones(3)), torch.full((3,), 2.0))
    assert doubled.fell_back and "eagerly" in caplog.text


def test_the_fused_function_is_traced_on_fake_copies_never_run_on_the_real_chunk(monkeypatch):
    """The trace runs on fake copies: a "real" make_fx trace would run the eager function on the
    chunk itself (its ~25 chunk-sized temporaries at once: 12 GiB transient at ImageNet-21K's chunk
    shape)."""
    from torch._subclasses.fake_tensor import FakeTensor

    from trainer.classifier.terms import inductor_fusion

    seen = []

    def record(x):
        seen.append(isinstance(x, FakeTensor))
        return x * 2

    monkeypatch.setattr(torch._inductor, "compile", lambda graph, example: graph)  # the trace is what is tested
    kernel = inductor_fusion.compile_for(record, (torch.ones(4, 3),))
    assert seen == [True]  # traced once, on a fake copy
    assert torch.equal(kernel(torch.ones(4, 3)), torch.full((4, 3), 2.0))


@pytest.mark.integration
def test_a_compiled_graph_is_loaded_from_inductors_cache_the_second_time():
    """Inductor's FX graph cache (on disk, shared by a job's ranks and by later pods) serves the second
    compile of the same graph: it is skipped, not bypassed, which a bare `torch._inductor.compile` does
    for lack of a shape environment."""
    import random

    from torch._dynamo.utils import counters

    from trainer.classifier.terms import inductor_fusion

    def scaled_exp(x, scale):
        return torch.exp(x * scale).sum(0)

    args = (torch.randn(6, 5), random.random())  # a constant never compiled before: a new graph
    counters.clear()
    first = inductor_fusion.compile_for(scaled_exp, args)
    assert dict(counters["inductor"]) == {"fxgraph_cache_miss": 1}, dict(counters["inductor"])
    second = inductor_fusion.compile_for(scaled_exp, args)
    assert counters["inductor"]["fxgraph_cache_hit"] == 1, dict(counters["inductor"])
    torch.testing.assert_close(second(args[0]), scaled_exp(*args))
    torch.testing.assert_close(first(args[0]), second(args[0]), rtol=0, atol=0)
