"""SyncBatchNorm's pieces on one device, in one process: `python -m trainer.bench.sync_batch_norm_check`.

1. Exactness: a batch split into k pseudo-ranks (unequal, one empty), each rank's statistics and
   gradient sums computed by ``trainer.parallel.batch_norm_pieces`` on the device (on CUDA: torch's
   fused kernels), the collectives replaced by a stack and a sum, against float64 BatchNorm over the
   whole batch on the CPU: the output, the input's gradient and the weight's and bias's, and the
   running statistics.  The largest errors are printed; the check fails above 1e-4.
2. Cost: at ResNet-50's BatchNorm shapes in bf16 channels_last, the forward and backward of
   ``SyncBatchNorm`` on its synchronised path over a group of one (``synchronize_alone``), beside
   plain ``nn.BatchNorm2d``: milliseconds and, on CUDA, peak memory above the input.

Written for a lent GPU (``scripts/gpu_check.sh syncbn``), runnable on CPU, where it checks the tensor
path instead of the kernels.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainer.parallel.batch_norm_pieces import (
    combine_rows,
    gradient_sums,
    input_gradient,
    parameter_gradients,
    rank_row,
)
from trainer.parallel.single_process import single_process_job
from trainer.parallel.sync_batch_norm import convert_to_sync_batch_norm

EPS, MOMENTUM, TOLERANCE = 1e-5, 0.1, 1e-4
# ResNet-50 at 224 px: every BatchNorm's (channels, side), once each
RESNET50_SHAPES = [(64, 112), (64, 56), (256, 56), (128, 28), (512, 28), (256, 14), (1024, 14), (512, 7), (2048, 7)]


def _worst(found: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest error relative to the expected values' scale."""
    return float((found.double().cpu() - expected).abs().max() / expected.abs().max().clamp_min(1e-12))


def pseudo_ranks(device: torch.device, sizes=(5, 0, 7, 4), channels: int = 8, side: int = 5) -> dict[str, float]:
    """Check 1 on ``device``: the largest relative error of each quantity."""
    generator = torch.Generator().manual_seed(0)
    offsets = torch.linspace(-50, 50, channels, dtype=torch.float64).view(1, -1, 1, 1)  # means far from zero
    full = torch.randn(sum(sizes), channels, side, side, generator=generator, dtype=torch.float64) * 2 + offsets
    grad_out = torch.randn(full.shape, generator=generator, dtype=torch.float64)
    weight = torch.rand(channels, generator=generator, dtype=torch.float64) + 0.5
    bias = torch.rand(channels, generator=generator, dtype=torch.float64) - 0.5
    whole = full.clone().requires_grad_()
    w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    running_mean, running_var = torch.zeros(channels, dtype=torch.float64), torch.ones(channels, dtype=torch.float64)
    expected = F.batch_norm(whole, running_mean, running_var, w, b, True, MOMENTUM, EPS)
    expected.backward(grad_out)

    pieces = [p.to(device, torch.float32).contiguous(memory_format=torch.channels_last)
              for p in full.split(list(sizes))]
    grads = [g.to(device, torch.float32).contiguous(memory_format=torch.channels_last)
             for g in grad_out.split(list(sizes))]
    dtype = torch.float32
    rows = torch.stack([rank_row(p, dtype, EPS) for p in pieces])  # the all-gather
    mean, variance, unbiased, count = combine_rows(rows, channels)
    invstd = (variance + EPS).rsqrt()
    w32, b32 = weight.to(device, dtype), bias.to(device, dtype)
    outputs = [F.batch_norm(p, mean, variance, w32, b32, False, 0.0, EPS) for p in pieces]
    own = [gradient_sums(g, p, mean, invstd) for g, p in zip(grads, pieces)]
    summed = torch.stack(own).sum(0)  # the all-reduce
    grad_inputs = [input_gradient(g, p, mean, invstd, w32, summed, count) for g, p in zip(grads, pieces)]
    grad_weight = sum(parameter_gradients(o, invstd)[0] for o in own)  # the data-parallel reduction
    grad_bias = sum(parameter_gradients(o, invstd)[1] for o in own)
    moved_mean = torch.zeros(channels, device=device).lerp_(mean, MOMENTUM)
    moved_var = torch.ones(channels, device=device).lerp_(unbiased, MOMENTUM)
    return dict(output=_worst(torch.cat(outputs), expected.detach()),
                grad_input=_worst(torch.cat(grad_inputs), whole.grad), grad_weight=_worst(grad_weight, w.grad),
                grad_bias=_worst(grad_bias, b.grad), running_mean=_worst(moved_mean, running_mean),
                running_var=_worst(moved_var, running_var))


def _timed(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor, repeats: int) -> tuple[float, int]:
    """Milliseconds per forward and backward, and the peak bytes allocated above what was there."""
    cuda = x.is_cuda
    for _ in range(2):
        layer(x).backward(grad)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0
    start = time.perf_counter()
    for _ in range(repeats):
        x.grad = None
        layer(x).backward(grad)
    if cuda:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / repeats
    return seconds * 1e3, (torch.cuda.max_memory_allocated() - before) if cuda else 0


def resnet50_costs(device: torch.device, batch: int, repeats: int) -> list[dict]:
    """Check 2: per shape, SyncBatchNorm (synchronised over a group of one) beside BatchNorm2d."""
    rows = []
    for channels, side in RESNET50_SHAPES:
        x = torch.randn(batch, channels, side, side, device=device, dtype=torch.bfloat16)
        x = x.contiguous(memory_format=torch.channels_last).requires_grad_()
        grad = torch.randn_like(x)
        plain = nn.BatchNorm2d(channels, device=device)  # fp32 parameters and statistics, bf16 activations
        synced = convert_to_sync_batch_norm(nn.Sequential(nn.BatchNorm2d(channels, device=device)),
                                            dist.group.WORLD, synchronize_alone=True)
        row = dict(shape=[batch, channels, side, side])
        row["plain_ms"], row["plain_peak_bytes"] = _timed(plain, x, grad, repeats)
        row["sync_ms"], row["sync_peak_bytes"] = _timed(synced, x, grad, repeats)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=64, help="images per rank at ResNet-50's shapes (default 64)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    errors = pseudo_ranks(device)
    print(f"pseudo-ranks [5, 0, 7, 4] on {device} ({'fused kernels' if device.type == 'cuda' else 'tensor path'}) "
          "against float64 BatchNorm over the whole batch, largest relative error:")
    for name, error in errors.items():
        print(f"  {name:<13}{error:.2e}")
    with single_process_job():  # a group of one for SyncBatchNorm's synchronised path
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                                    device_id=device if device.type == "cuda" else None)
        costs = resnet50_costs(device, args.batch, args.repeats)
        dist.destroy_process_group()
    print(f"ResNet-50 BatchNorm shapes, bf16 channels_last, forward + backward, {args.repeats} repeats:")
    for row in costs:
        plain, synced = (f"{row[k + '_ms']:7.3f} ms {row[k + '_peak_bytes'] / 2**20:8.1f} MiB"
                         for k in ("plain", "sync"))
        print(f"  {str(row['shape']):<22} BatchNorm2d {plain}   SyncBatchNorm {synced}")
    if args.json:
        args.json.write_text(json.dumps(dict(device=str(device), torch=torch.__version__, errors=errors, costs=costs),
                                        indent=1))
    worst = max(errors.values())
    if worst > TOLERANCE:
        print(f"FAILED: an error of {worst:.2e} is above {TOLERANCE:g}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
