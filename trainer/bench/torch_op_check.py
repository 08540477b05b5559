"""Do instcls's classifier and torch's op compute the same thing?  The loss, the features' gradient
and the rows' gradient of one problem, from each, compared.

instcls runs with the row update after the backward, where the rows' gradient exists (inside the
backward it is applied chunk by chunk and never whole).  The problem is the bench's: instcls's
initial rows, rank 0's ids and features (``synthetic_batch``).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from trainer.bench.torch_op import TorchOpChoice, cosine_cross_entropy, resolve
from trainer.bench.torch_op_steps import initial_rows, synthetic_batch
from trainer.classifier import ClassifierConfig, ShardedCosineClassifier
from trainer.parallel import ParallelDims, init_distributed
from trainer.parallel.launch import spawn_local_workers

# Largest difference allowed, relative to the quantity's largest magnitude: fp32 rounding of sums
# over N classes, and half-precision features and logits.
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}
QUANTITIES = ("loss", "features_grad", "weight_grad")


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """``max |ours - theirs|`` over ``max |theirs|``, in float64."""
    ours, theirs = ours.detach().double(), theirs.detach().double()
    if ours.shape != theirs.shape:
        raise ValueError(f"shapes differ: {tuple(ours.shape)} vs {tuple(theirs.shape)}")
    scale = theirs.abs().max().item()
    return (ours - theirs).abs().max().item() / max(scale, torch.finfo(torch.float64).tiny)


def agreement(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], tolerance: float) -> dict:
    """Each quantity's relative error and whether all are within ``tolerance``."""
    errors = {name: relative_error(ours[name], theirs[name]) for name in QUANTITIES}
    return dict(errors=errors, tolerance=tolerance, agree=all(error <= tolerance for error in errors.values()))


def instcls_results(config: ClassifierConfig, dims: ParallelDims, ids: torch.Tensor, features: torch.Tensor) -> dict:
    """``QUANTITIES`` from instcls's classifier of ``config`` (its initial rows)."""
    classifier = ShardedCosineClassifier(config, dims)
    inputs = features.detach().clone().requires_grad_()
    loss = classifier(inputs, ids)
    loss.backward()
    return dict(loss=loss.detach(), features_grad=inputs.grad, weight_grad=classifier.weight.grad)


def torch_op_results(config: ClassifierConfig, choice: TorchOpChoice, device: torch.device, ids: torch.Tensor,
                     features: torch.Tensor) -> dict:
    """``QUANTITIES`` from torch's op called as ``choice`` on the same initial rows."""
    weight = initial_rows(config, device)
    inputs = features.detach().clone().requires_grad_()
    loss = cosine_cross_entropy(inputs, weight, ids, config.temperature, choice)
    loss.backward()
    return dict(loss=loss.detach(), features_grad=inputs.grad, weight_grad=weight.grad)


def check_against_torch(num_classes: int, batch: int, dim: int, dtype: str, chunk_size: int, setting: str,
                        dims: ParallelDims) -> dict:
    """instcls's classifier (one rank, rows updated after the backward) against torch's op with
    ``setting``, on ``dims.device``: ``agreement`` plus the setting's name and both losses."""
    device = dims.device
    config = ClassifierConfig(num_classes=num_classes, feature_dim=dim, chunk_size=chunk_size, mode="dhp",
                              validate_inputs=False)
    ids, features = synthetic_batch(num_classes, batch, dim, getattr(torch, dtype), device, rank=0)
    ours = instcls_results(config, dims, ids, features)
    choice = resolve(setting, batch, num_classes, dim, getattr(torch, dtype), device)
    theirs = torch_op_results(config, choice, device, ids, features)
    result = agreement(ours, theirs, TOLERANCE[dtype])
    return dict(result, setting=choice.label, losses=dict(instcls=ours["loss"].item(), torch=theirs["loss"].item()))


def _worker(arguments: tuple, result_path: str) -> None:
    dims = init_distributed()
    Path(result_path).write_text(json.dumps(check_against_torch(*arguments, dims=dims)))


def run_check(num_classes: int, batch: int, dim: int, dtype: str, chunk_size: int, setting: str) -> dict:
    """``check_against_torch`` in a fresh process (its memory is the bench's largest: both gradients)."""
    with tempfile.TemporaryDirectory() as tmp:
        result_path = str(Path(tmp) / "check.json")
        spawn_local_workers(_worker, 1, (num_classes, batch, dim, dtype, chunk_size, setting), result_path)
        return json.loads(Path(result_path).read_text())
