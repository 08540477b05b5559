"""Input checks for the classifier that fail on every rank together, never leaving one hanging.

A rank that raised alone would leave the others waiting forever in the next collective, so each
rank first checks its own batch, then all ranks exchange one small tensor (which ranks failed, and
the min/max local batch size) and all raise if anything is wrong.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainer.parallel.collectives import Group, all_reduce_, group_rank, group_size


class ClassifierInputError(ValueError):
    """A batch given to the instance classifier is malformed."""


def local_input_problem(
    features: torch.Tensor,
    instance_ids: torch.Tensor,
    hard_negative_ids: torch.Tensor | None,
    num_classes: int,
    feature_dim: int,
) -> str | None:
    """What is wrong with this rank's batch, or ``None``."""
    if features.dim() != 2 or features.shape[1] != feature_dim:
        return (
            f"features has shape {tuple(features.shape)} but the classifier expects [batch, {feature_dim}]; "
            "set classifier.feature_dim to the projection head's output width"
        )
    if features.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"features has dtype {features.dtype}; use float32, bfloat16 or float16"
    batch = features.shape[0]
    if instance_ids.shape != (batch,) or instance_ids.dtype.is_floating_point:
        return (
            f"instance_ids has shape {tuple(instance_ids.shape)} and dtype {instance_ids.dtype}; "
            f"expected integer ids of shape ({batch},), one per feature row"
        )
    bad = _out_of_range(instance_ids, num_classes)
    if bad is not None:
        return f"instance_ids contains {bad}, outside [0, {num_classes}); ids must be dense instance indices 0..N-1"
    if hard_negative_ids is None:
        return None
    if hard_negative_ids.dim() != 2 or hard_negative_ids.shape[0] != batch or hard_negative_ids.dtype.is_floating_point:
        return (
            f"hard_negative_ids has shape {tuple(hard_negative_ids.shape)} and dtype {hard_negative_ids.dtype}; "
            f"expected integer ids of shape ({batch}, K)"
        )
    top_k = hard_negative_ids.shape[1]
    if top_k > num_classes - 1:
        return (
            f"hard_negative_ids has K={top_k} columns but an instance has only {num_classes - 1} other "
            "classes; lower objective.top_k"
        )
    bad = _out_of_range(hard_negative_ids, num_classes)
    if bad is not None:
        return f"hard_negative_ids contains {bad}, outside [0, {num_classes})"
    if bool((hard_negative_ids == instance_ids[:, None]).any()):
        return "hard_negative_ids lists a sample's own instance id; hard negatives must be *other* classes"
    return None


def poison_out_of_range(per_sample_loss: torch.Tensor, target_ids: torch.Tensor, num_classes: int) -> torch.Tensor:
    """The per-sample loss with NaN wherever a sample's target ids leave ``[0, num_classes)``.

    The check that stays on when ``validate_inputs`` is off: such an id has no row on any shard, so
    the kernel would silently drop its target term and train on a wrong loss.  Marking the sample
    NaN costs no host sync and no collective (every rank of the group holds the same gathered ids);
    the trainer's non-finite watch stops the run at its next check, and no gradient flows from the
    marked samples meanwhile (``masked_fill`` passes none to filled entries).
    """
    bad = ((target_ids < 0) | (target_ids >= num_classes)).any(dim=1)
    return per_sample_loss.masked_fill(bad, float("nan"))


def _out_of_range(ids: torch.Tensor, num_classes: int) -> int | None:
    bad = (ids < 0) | (ids >= num_classes)
    return int(ids[bad][0]) if bool(bad.any()) else None


def check_inputs_on_all_ranks(problem: str | None, batch_size: int, group: Group, device: torch.device) -> None:
    """Raise ``ClassifierInputError`` on every rank of ``group`` if any rank found a problem or the
    local batch sizes differ."""
    size, rank = group_size(group), group_rank(group)
    # Layout: one failure flag per rank, then max(batch) and max(-batch) in a single MAX all-reduce.
    summary = torch.zeros(size + 2, dtype=torch.int64, device=device)
    summary[rank] = problem is not None
    summary[size] = batch_size
    summary[size + 1] = -batch_size
    all_reduce_(summary, dist.ReduceOp.MAX, group)
    summary = summary.tolist()
    failed = [r for r in range(size) if summary[r]]
    if problem is not None:
        raise ClassifierInputError(f"rank {rank}: {problem}")
    if failed:
        raise ClassifierInputError(f"rank {rank}: invalid classifier input on rank(s) {failed}; see their error")
    largest, smallest = summary[size], -summary[size + 1]
    if largest != smallest:
        raise ClassifierInputError(
            f"rank {rank}: local batch sizes differ across ranks ({smallest} to {largest}); every rank must "
            "give the classifier the same number of samples (use drop_last or pad_last_batch in the loader)"
        )
