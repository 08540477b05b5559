"""The features' all-gather backward sums half-precision gradients over the ranks in fp32.

No process group is needed: the collectives are replaced by a fake 64-rank group whose
reduce-scatter sums the ranks' contributions one hop at a time *in the dtype it is handed*, as the
NCCL and gloo rings do.  Summing bf16 gradients in bf16 rounds 63 times; in fp32 the sum of 64 bf16
numbers of similar magnitude is exact, so the gradient is the float64 sum rounded once to bf16.
"""

import torch
import torch.distributed as dist

from trainer.parallel import collectives

WORLD, ROWS, DIM = 64, 3, 16


def test_all_gather_backward_reduces_bf16_gradients_in_fp32(monkeypatch):
    generator = torch.Generator().manual_seed(0)
    # What every rank computed for rank 0's rows (the block this rank gets back).
    contributions = torch.randn(WORLD, ROWS, DIM, generator=generator).to(torch.bfloat16)
    seen_dtypes = []

    def reduce_scatter_single(out, tensor, group=None):
        seen_dtypes.append(tensor.dtype)
        total = torch.zeros(ROWS, DIM, dtype=tensor.dtype)
        for contribution in contributions:  # one ring hop per rank, in the handed dtype
            total += contribution.to(tensor.dtype)
        out.copy_(total)

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: WORLD)
    monkeypatch.setattr(dist, "all_gather_single", lambda out, tensor, group=None: out.copy_(tensor.repeat(WORLD, 1)))
    monkeypatch.setattr(dist, "reduce_scatter_single", reduce_scatter_single)

    features = torch.zeros(ROWS, DIM, dtype=torch.bfloat16, requires_grad=True)
    gathered = collectives.all_gather_rows_with_grad(features, group=object())
    gathered.backward(torch.zeros_like(gathered))  # the fake ignores the local values

    exact = contributions.double().sum(dim=0)
    assert torch.equal(features.grad, exact.to(torch.bfloat16)), "the sum is rounded once, to bf16"
    assert seen_dtypes == [torch.float32] and features.grad.dtype == torch.bfloat16


def test_torch_without_the_single_tensor_names_uses_the_old_ones(monkeypatch):
    """torch 2.11 (the GPU machines' image) has no ``all_gather_single``/``reduce_scatter_single``."""
    from trainer.parallel import collectives

    called = []
    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    monkeypatch.delattr(dist, "reduce_scatter_single", raising=False)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather_into_tensor", lambda out, t, group=None: called.append("gather") or
                        out.copy_(t.repeat(2, 1)))
    monkeypatch.setattr(dist, "reduce_scatter_tensor", lambda out, t, group=None: called.append("scatter") or
                        out.copy_(t[: out.shape[0]]))
    rows = torch.arange(6.0).view(3, 2)
    assert torch.equal(collectives.gather_rows(rows, object()), rows.repeat(2, 1))
    assert torch.equal(collectives.reduce_scatter_rows(rows.repeat(2, 1), object()), rows)
    assert called == ["gather", "scatter"]
