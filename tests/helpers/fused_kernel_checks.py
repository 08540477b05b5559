"""The fused Triton kernels under Triton's interpreter (CPU tensors), against the float64 reference.

Run as ``python -m tests.helpers.fused_kernel_checks NAME`` by ``tests/unit/test_fused_kernel.py``:
``TRITON_INTERPRET=1`` must be set before ``triton`` is first imported, so each check runs in a
process of its own (the rest of the suite imports Triton, through inductor, without it).  A check
raises on the first case outside its tolerance, naming the case; exit status 0 means all passed.
With ``INSTCLS_FUSED_DEVICE=cuda`` (a GPU node, marker ``gpu``) the same cases run the compiled
kernels on the GPU instead, against the same float64 reference on the CPU.

Tolerances, as relative norms ``|kernel - reference| / |reference|``: fp32 features 1e-5 (fp32
arithmetic in a different order); bf16 features 2e-2 (the features and the scaled weight rows are
rounded to bf16 once, as on a GPU; the interpreter rounds its fp32 -> bf16 casts toward zero, a
GPU to nearest, so its error is up to twice a GPU's).
"""

from __future__ import annotations

import itertools
import os
import sys

DEVICE = os.environ.get("INSTCLS_FUSED_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tests.helpers.reference import random_hard_negatives, reference_grads, reference_loss  # noqa: E402
from trainer.classifier.in_backward_sgd import InBackwardSGD  # noqa: E402
from trainer.classifier.kernel.chunked import KernelSettings, sharded_cosine_ce  # noqa: E402

NUM_ROWS, DIM, BATCH, TOP_K, TAU = 45, 24, 19, 4, 0.15  # D=24 pads to a 32-wide tile; 19 spans 2 feature blocks
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = (torch.float32, torch.bfloat16)


def _relative(value, reference) -> float:
    return float((value.double() - reference).norm() / reference.norm().clamp_min(1e-30))


def _check(label: str, dtype, pairs) -> None:
    for name, value, reference in pairs:
        error = _relative(value, reference)
        if not error <= TOLERANCE[dtype]:  # NaN fails too
            raise AssertionError(f"{label}: {name} off by {error:.2e} (tolerance {TOLERANCE[dtype]:.0e})")


def _subset(kind: str):
    """``(kernel rows argument, index of W)`` of the scored rows."""
    if kind == "all":
        return None, torch.arange(NUM_ROWS)
    if kind == "window":
        return slice(6, 39), torch.arange(6, 39)
    sampled = torch.randperm(NUM_ROWS, generator=torch.Generator().manual_seed(3))[:29]
    return sampled, sampled


def _problem(num_scored: int, alpha: float, seed: int):
    generator = torch.Generator().manual_seed(seed)
    features = F.normalize(torch.randn(BATCH, DIM, generator=generator), dim=1)
    weight = torch.randn(NUM_ROWS, DIM, generator=generator)
    ids = torch.randint(0, num_scored, (BATCH,), generator=generator)
    hard = random_hard_negatives(ids, num_scored, TOP_K, generator) if alpha else None
    targets = ids[:, None] if hard is None else torch.cat([ids[:, None], hard], dim=1)
    weights = torch.tensor([[1.0]] if hard is None else [[1 - alpha] + [alpha / TOP_K] * TOP_K])
    return features, weight, ids, hard, targets, weights.expand(BATCH, -1)


def _fused(form: str, chunk_size: int = 16) -> KernelSettings:
    return KernelSettings(temperature=TAU, chunk_size=chunk_size, form=form, implementation="fused")


def _run(features, weight, targets, weights, settings, rows=None, update=None, scale=None, group=None):
    """``(sum of scale * per-sample loss, dL/dfeatures, dL/dW)``; features in their own dtype."""
    x = features.to(DEVICE, copy=True).requires_grad_()
    w = torch.nn.Parameter(weight.to(DEVICE, copy=True))
    if isinstance(rows, torch.Tensor):
        rows = rows.to(DEVICE)
    per_sample = sharded_cosine_ce(x, w, targets.to(DEVICE), weights.to(DEVICE), settings, group, rows=rows,
                                   update_in_backward=update)
    scale = torch.full((BATCH,), 1.0 / BATCH) if scale is None else scale
    total = (per_sample * scale.to(DEVICE)).sum()
    total.backward()
    return total.detach().cpu(), x.grad.cpu(), w.grad.cpu()


def _reference(features, scored_weight, ids, hard, alpha, form, scale=None):
    """Loss and gradients of ``sum_i scale_i L_i`` in float64 (the reference averages: rescale)."""
    if scale is None:
        return reference_grads(features, scored_weight, ids, hard, alpha, TAU, form, unit_features=True)
    x = features.double().requires_grad_()
    w = scored_weight.double().requires_grad_()
    per_sample = torch.stack([  # reference_loss averages over its batch: one sample at a time
        reference_loss(x[i: i + 1], w, ids[i: i + 1], None if hard is None else hard[i: i + 1], alpha, TAU, form,
                       unit_features=True) for i in range(BATCH)])
    total = (per_sample * scale.double()).sum()
    total.backward()
    return total.detach(), x.grad, w.grad


def every_case_on_one_rank() -> None:
    """All rows, a window, sampled rows; both smoothing forms with and without top-K targets; fp32
    and bf16 features; chunks that divide none of the subsets."""
    for seed, (dtype, kind, form, alpha) in enumerate(
            itertools.product(DTYPES, ["all", "window", "sampled"], ["paper", "soft_target"], [0.0, 0.2])):
        rows, index = _subset(kind)
        features, weight, ids, hard, targets, weights = _problem(index.numel(), alpha, seed)
        features = features.to(dtype)
        loss, grad_x, grad_w = _run(features, weight, targets, weights, _fused(form, chunk_size=13), rows)
        ref_loss, ref_x, ref_scored = _reference(features, weight[index], ids, hard, alpha, form)
        ref_w = torch.zeros(NUM_ROWS, DIM, dtype=torch.float64).index_add_(0, index, ref_scored)
        _check(f"{dtype} {kind} {form} alpha={alpha}", dtype,
               [("loss", loss, ref_loss), ("dL/dx", grad_x, ref_x), ("dL/dW", grad_w, ref_w)])


def padding_and_negative_weights() -> None:
    """The valid mask (padding samples weighted 0) and negative loss weights: a padding sample's
    feature gradient is exactly 0, the rest matches the reference."""
    for dtype, form in itertools.product(DTYPES, ["paper", "soft_target"]):
        features, weight, ids, hard, targets, weights = _problem(NUM_ROWS, 0.2, 7)
        features = features.to(dtype)
        valid = torch.arange(BATCH) % 4 != 1
        scale = torch.where(valid, torch.linspace(-1.0, 1.5, BATCH), 0.0)
        loss, grad_x, grad_w = _run(features, weight, targets, weights, _fused(form), scale=scale)
        assert torch.equal(grad_x[~valid], torch.zeros_like(grad_x[~valid])), f"{dtype} {form}: padding gradient"
        ref_loss, ref_x, ref_w = _reference(features, weight, ids, hard, 0.2, form, scale=scale)
        _check(f"{dtype} {form} padding and negative weights", dtype,
               [("loss", loss, ref_loss), ("dL/dx", grad_x, ref_x), ("dL/dW", grad_w, ref_w)])


def in_backward_sgd() -> None:
    """``update_in_backward``: the rows the fused backward updates chunk by chunk equal torch's SGD
    applied to the reference gradient, and no other row moves."""
    for dtype, kind in itertools.product(DTYPES, ["window", "sampled"]):
        rows, index = _subset(kind)
        features, weight, ids, hard, targets, weights = _problem(index.numel(), 0.2, 11)
        features = features.to(dtype)
        w = torch.nn.Parameter(weight.to(DEVICE, copy=True))
        update = InBackwardSGD(w, lr=0.5, momentum=0.9, weight_decay=1e-3)
        momentum_before = torch.randn_like(weight) * 0.1
        update.state[w]["momentum_buffer"] = momentum_before.to(DEVICE, copy=True)
        x = features.to(DEVICE, copy=True).requires_grad_()
        sharded_cosine_ce(x, w, targets.to(DEVICE), weights.to(DEVICE), _fused("paper", chunk_size=7), None,
                          rows=rows.to(DEVICE) if isinstance(rows, torch.Tensor) else rows,
                          update_in_backward=update).mean().backward()
        assert w.grad is None, "the update consumed the gradient"
        _, _, ref_scored = _reference(features, weight[index], ids, hard, 0.2, "paper")
        grad = ref_scored + 1e-3 * weight[index].double()
        buffer = 0.9 * momentum_before[index].double() + grad
        expected = weight.double().clone()
        expected[index] -= 0.5 * buffer
        untouched = torch.ones(NUM_ROWS, dtype=torch.bool).index_fill_(0, index, False)
        updated = w.data.cpu()
        assert torch.equal(updated[untouched], weight[untouched]), f"{dtype} {kind}: an unscored row moved"
        _check(f"{dtype} {kind} in-backward SGD", dtype, [("updated rows", updated[index] - weight[index],
                                                            expected[index] - weight[index].double())])


def deterministic_repeats() -> None:
    """Under torch's deterministic algorithms (``parallel.deterministic``) two runs of a step give the
    same bits: the kernels run their first tile configuration, not the autotuner's timing-based pick."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    rows, index = _subset("sampled")
    features, weight, ids, hard, targets, weights = _problem(index.numel(), 0.2, 21)
    for dtype in DTYPES:
        first, second = (_run(features.to(dtype), weight, targets, weights, _fused("paper", 13), rows)
                         for _ in range(2))
        for name, a, b in zip(("loss", "dL/dx", "dL/dW"), first, second):
            assert torch.equal(a, b), f"{dtype}: {name} differs between two deterministic runs"


def ops_trace_under_compile() -> None:
    """The kernels are custom ops with fake implementations: ``torch.compile(fullgraph=True)`` traces
    a step's three ops without a graph break and computes what eager calls compute."""
    from trainer.classifier.kernel import fused_ops  # noqa: F401  (registers the ops)

    features, weight, *_ = _problem(NUM_ROWS, 0.0, 31)
    inv_norm = weight.norm(dim=1).reciprocal()
    coef, shift = torch.linspace(-1, 1, BATCH), torch.full((BATCH,), 3.0)

    def step(features, weight, inv_norm, coef, shift):
        partial = torch.empty(2, BATCH)
        torch.ops.instcls.cosine_sum_exp(features, weight, None, 0, NUM_ROWS, inv_norm, 2.0, partial)
        grad_x = torch.empty(2, BATCH, 32)
        torch.ops.instcls.cosine_grad_features(features, weight, None, 0, NUM_ROWS, inv_norm, 2.0, coef, shift,
                                               grad_x)
        grad_w = torch.empty(NUM_ROWS, DIM)
        torch.ops.instcls.cosine_grad_rows(features, weight, None, 0, 0, NUM_ROWS, inv_norm, 2.0, coef, shift,
                                           0.5, grad_w)
        return partial.sum(0), grad_x.sum(0)[:, :DIM], grad_w

    eager = step(features, weight, inv_norm, coef, shift)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(features, weight, inv_norm, coef, shift)
    for name, a, b in zip(("sum of exponentials", "feature gradient", "row gradient"), eager, compiled):
        assert torch.equal(a, b), f"{name}: compiled differs from eager"


def _two_ranks() -> None:
    from trainer.parallel import init_distributed

    dims = init_distributed()
    rank, world, group = dims.rank, dims.world_size, dims.classifier_group
    for seed, (dtype, form, alpha, sampled) in enumerate(
            itertools.product(DTYPES, ["paper", "soft_target"], [0.0, 0.2], [False, True])):
        # Uneven shards: 45 rows split 23 / 22; sampled: every other row of each shard.
        scored_by_rank = [shard[::2] if sampled else shard for shard in torch.arange(NUM_ROWS).tensor_split(world)]
        union = torch.cat(scored_by_rank)
        features, weight, ids, hard, targets, weights = _problem(union.numel(), alpha, 100 + seed)
        features = features.to(dtype)
        mine = scored_by_rank[rank]
        offset = sum(rows.numel() for rows in scored_by_rank[:rank])
        local_cols = torch.where((targets >= offset) & (targets < offset + mine.numel()), targets - offset, -1)
        rows = mine if sampled else slice(int(mine[0]), int(mine[-1]) + 1)
        loss, grad_x, grad_w = _run(features, weight, local_cols, weights, _fused(form, chunk_size=9), rows,
                                    group=group)
        dist.all_reduce(grad_x, group=group)  # each rank holds its shard's share of dL/dx (CPU tensors: gloo)
        ref_loss, ref_x, ref_union = _reference(features, weight[union], ids, hard, alpha, form)
        ref_w = torch.zeros(NUM_ROWS, DIM, dtype=torch.float64).index_add_(0, union, ref_union)
        _check(f"rank {rank} {dtype} {form} alpha={alpha} sampled={sampled}", dtype,
               [("loss", loss, ref_loss), ("dL/dx", grad_x.float(), ref_x), ("dL/dW", grad_w[mine], ref_w[mine])])


def two_gloo_ranks() -> None:
    from trainer.parallel.launch import spawn_local_workers

    spawn_local_workers(_two_ranks, 2)


def positive_logit_and_frozen_rows() -> None:
    """MoCo's queue as the rows: a per-sample positive logit that is no row joins the softmax as its
    target, and rows that need no gradient (the queue) get no row-gradient kernel; the loss and the
    gradients of the features and of the positive's key match ``F.cross_entropy`` on the full float64
    ``[B, 1 + K]`` logits."""
    from tests.helpers.moco_reference import reference_infonce
    from trainer.classifier.kernel import fused

    def no_row_gradient(*args, **kwargs):
        raise AssertionError("the fused backward computed a gradient for rows that need none")

    fused._grad_weight = no_row_gradient
    generator = torch.Generator().manual_seed(41)
    query = F.normalize(torch.randn(BATCH, DIM, generator=generator), dim=1)
    key = F.normalize(query + 0.5 * torch.randn(BATCH, DIM, generator=generator), dim=1)
    queue = F.normalize(torch.randn(NUM_ROWS, DIM, generator=generator), dim=1)
    no_rows = torch.empty(BATCH, 0, dtype=torch.int64, device=DEVICE)
    for dtype, form in itertools.product(DTYPES, ["paper", "soft_target"]):
        q = query.to(dtype).to(DEVICE, copy=True).requires_grad_()
        k = key.to(DEVICE, copy=True).requires_grad_()
        positive = (q.float() * k).sum(dim=1) / TAU
        loss = sharded_cosine_ce(q, queue.to(DEVICE), no_rows, torch.ones(BATCH, 1, device=DEVICE),
                                 _fused(form, chunk_size=13), None, positive_logits=positive).mean()
        loss.backward()
        ref_loss, _, ref_q, ref_k = reference_infonce(query.to(dtype).float(), key, queue, TAU)
        _check(f"{dtype} {form} positive logit, frozen rows", dtype,
               [("loss", loss.detach().cpu(), ref_loss), ("dL/dq", q.grad.cpu(), ref_q),
                ("dL/dk", k.grad.cpu(), ref_k)])


CHECKS = {f.__name__: f for f in (every_case_on_one_rank, padding_and_negative_weights, in_backward_sgd,
                                  deterministic_repeats, ops_trace_under_compile, two_gloo_ranks,
                                  positive_logit_and_frozen_rows)}

if __name__ == "__main__":
    CHECKS[sys.argv[1]]()
    print(f"{sys.argv[1]}: passed")
