"""The flags of `instcls plan` that describe a job: their values without --config, and with --config
the config override each one stands for.

Their parser default is ``None`` (switches: ``False``), so a flag the user gave is told apart from
one they did not.  Without --config an absent flag takes its value here.  With --config a given flag
is applied as the ``--set`` override that says the same, and the command prints it; a flag that no
one override says exactly (the dtype and ZeRO stage come from the DeepSpeed config file, CO2 needs
its weight) is refused, naming the override to use instead.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class JobFlag:
    """``dest``: the parsed name; ``default``: its value without --config; ``override``: its value
    as a config override (``None``: refused with --config); ``instead``: what to give instead."""

    dest: str
    default: object
    override: Callable[[object, argparse.Namespace], str] | None = None
    instead: str = ""

    @property
    def flag(self) -> str:
        return "--" + self.dest.replace("_", "-")

    @property
    def switch(self) -> bool:
        """A ``store_true`` flag: its parser default is False, not None."""
        return isinstance(self.default, bool)

    def given_in(self, args: argparse.Namespace) -> bool:
        # ``is``, not ``in (None, False)``: 0 == False, and a flag given as 0 was given.
        value = getattr(args, self.dest)
        return value is True if self.switch else value is not None


def _per_rank_batch(value, args: argparse.Namespace) -> str:
    if value % args.ranks:
        raise SystemExit(f"instcls plan: --batch {value} is the global batch; with --config it is applied as "
                         f"data.loader.batch_size (per rank), and {args.ranks} ranks do not divide it: give a multiple "
                         f"of --ranks, or --set data.loader.batch_size=PER_RANK")
    return f"data.loader.batch_size={value // args.ranks}"


def _cache_bytes(gib: float) -> int:
    from trainer.planning import GIB  # the planner (torch) is imported when a plan runs, not when the CLI starts

    return int(gib * GIB)


def _backbone(name: str, args: argparse.Namespace) -> str:
    if name == "none":
        raise SystemExit("instcls plan: --backbone none plans the classifier alone, without --config; a config's "
                         "job always has its backbone (model.arch)")
    return f"model.arch={name}"


def _hard_negatives(k: int, args: argparse.Namespace) -> str:
    """``--top-k 0`` means no hard negatives, which a config says with the smoothing off (its
    ``top_k`` must stay >= 1)."""
    return "objective.smoothing_alpha=0" if k == 0 else f"objective.top_k={k}"


def _setting(key: str, value_text: Callable[[object], object] = lambda value: value):
    return lambda value, args: f"{key}={value_text(value)}"


JOB_FLAGS = (
    JobFlag("batch", 4096, _per_rank_batch),
    JobFlag("views", 2, _setting("data.loader.augment.num_views")),
    JobFlag("dim", 128, _setting("model.feature_dim")),
    JobFlag("chunk_size", 65536, _setting("objective.chunk_size")),
    JobFlag("logits_cache_gib", 0.0, _setting("objective.logits_cache_bytes", _cache_bytes)),
    JobFlag("dtype", "float32",
            instead="the DeepSpeed config's bf16 section sets it: --set deepspeed_config=zero0_autocast_bf16 "
            "(or another ds_configs/ file)"),
    JobFlag("backbone", "resnet50", _backbone),
    JobFlag("image_size", 224, _setting("data.loader.augment.image_size")),
    JobFlag("patch_size", None, _setting("model.patch_size")),
    JobFlag("zero_stage", 0,
            instead="every stage is planned from the config and the lowest that fits recommended; the breakdown is "
            "printed at its DeepSpeed config's stage: --set deepspeed_config=zero2_bf16 (or another ds_configs/ file)"),
    JobFlag("optimizer", "sgd", _setting("optim.name")),
    JobFlag("activation_checkpointing", False, _setting("model.activation_checkpointing", lambda on: "true")),
    JobFlag("deepspeed_config", None, _setting("deepspeed_config")),
    JobFlag("no_dali", False, _setting("data.loader.backend", lambda on: "torch")),
    JobFlag("no_momentum", False, _setting("optim.momentum", lambda on: 0)),
    JobFlag("update_in_backward", False, _setting("objective.update_in_backward", lambda on: "true")),
    JobFlag("cpu", False, _setting("parallel.device", lambda on: "cpu")),
    JobFlag("queue", 65536, _setting("objective.queue_size")),
    JobFlag("row_store", "host", _setting("objective.row_store")),
    JobFlag("co2", False, instead="--set objective.co2_alpha=ALPHA (the term's weight, > 0)"),
    JobFlag("kernel", "auto", _setting("objective.kernel")),
    JobFlag("top_k", 0, _hard_negatives),
)


def default_help(dest: str) -> str:
    """`` (default without --config: X)`` for a flag's help text."""
    default = next(flag.default for flag in JOB_FLAGS if flag.dest == dest)
    return f" (default without --config: {default})"


def given(args: argparse.Namespace) -> list[JobFlag]:
    """The flags the user gave, whatever their value: a value flag is given when it is not None (so
    ``--queue 0`` is given), a switch when it is True."""
    return [flag for flag in JOB_FLAGS if flag.given_in(args)]


def fill_defaults(args: argparse.Namespace) -> None:
    """Without --config: every flag not given takes its default."""
    for flag in JOB_FLAGS:
        if getattr(args, flag.dest) is None:
            setattr(args, flag.dest, flag.default)


def config_overrides(args: argparse.Namespace) -> list[str]:
    """With --config: the overrides the given flags stand for, after those of --set; a flag that no
    override says exactly is refused with what to give instead."""
    flags = given(args)
    refused = [f"{flag.flag} ({flag.instead})" for flag in flags if flag.override is None]
    if refused:
        raise SystemExit("instcls plan: with --config the job's settings come from the config; give these another "
                         "way: " + "; ".join(refused))
    return [flag.override(getattr(args, flag.dest), args) for flag in flags]
