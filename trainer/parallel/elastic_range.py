"""The world sizes an elastic job may run at, from ``instcls launch --nnodes MIN:MAX
--nproc-per-node P`` to its ranks: ``INSTCLS_WORLD_SIZES`` lists them (MIN x P, (MIN + 1) x P, ...,
MAX x P), so that the trainer can refuse, at the first start, a setting that one of them cannot
split (``trainer.elastic.world_range``) instead of failing days later at the first shrink."""

from __future__ import annotations

import os

from trainer.parallel.torchrun_arguments import option_value

WORLD_SIZES_ENV = "INSTCLS_WORLD_SIZES"


def world_sizes_of_launch(torchrun_args: list[str], environ=os.environ) -> tuple[int, ...] | None:
    """The world sizes ``--nnodes MIN:MAX`` and ``--nproc-per-node P`` allow (or torchrun's
    ``PET_NNODES`` and ``PET_NPROC_PER_NODE``, which Kubeflow's operator sets instead); None when
    the launch is not elastic, or its per-node count is not a number (``gpu``, ``auto``: the ranks
    count then)."""
    nnodes = option_value(torchrun_args, "--nnodes") or environ.get("PET_NNODES")
    per_node = option_value(torchrun_args, "--nproc-per-node", "--nproc_per_node") or environ.get("PET_NPROC_PER_NODE")
    if nnodes is None or ":" not in nnodes or per_node is None or not per_node.isdigit():
        return None
    low, high = (int(part) for part in nnodes.split(":", 1))
    return tuple(nodes * int(per_node) for nodes in range(low, high + 1))


def world_sizes_from_environment(environ=os.environ) -> tuple[int, ...] | None:
    """What the launcher put in ``INSTCLS_WORLD_SIZES`` (None: not an elastic launch)."""
    value = environ.get(WORLD_SIZES_ENV, "").strip()
    if not value:
        return None
    try:
        return tuple(int(size) for size in value.split(","))
    except ValueError:
        raise ValueError(f"{WORLD_SIZES_ENV}={value!r} is invalid: a comma-separated list of world sizes, as "
                         "`instcls launch --nnodes MIN:MAX` sets it; unset it for a job of fixed size") from None
