"""The backbone + head through ``deepspeed.initialize`` with a ZeRO config from ds_configs/."""

from __future__ import annotations

import torch
from torch import nn

from trainer.config import ConfigError
from trainer.config_deepspeed import apply_gradient_clipping, load_deepspeed_config
from trainer.optim import OptimizerSettings, build_optimizer, create_initial_state, optimizer_partitions
from trainer.parallel.deepspeed_import import deepspeed

# read and checked in the config layer, re-exported for the engine's callers
__all__ = ["apply_gradient_clipping", "engine_dtype", "initialize_backbone", "load_deepspeed_config"]


def _skip_the_shared_memory_inference_op() -> None:
    """DeepSpeed's CPU backend compiles a shared-memory all-reduce (``deepspeed_shm_comm``) with the
    machine's C++ compiler when it first starts: 25-75 s where ``TORCH_EXTENSIONS_DIR`` is empty (every
    new pod), a lock file that stalls later runs if a build is killed, and it serves only
    ``inference_all_reduce``, which training never calls.  Marked incompatible, DeepSpeed sends every
    collective through torch.distributed (gloo here), as it does on GPUs."""
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def initialize_backbone(model: nn.Module, ds_config: dict, lr: float, momentum: float = 0.9,
                        weight_decay: float = 0.0, settings: OptimizerSettings | None = None):
    """``(engine, optimizer)``; DeepSpeed averages the backbone gradients over all ranks.

    The optimizer is the one ``settings`` names (``trainer.optim``); without settings, SGD with
    ``momentum`` and ``weight_decay`` on every parameter.  An optimizer that needs to know how
    DeepSpeed cut the tensors it steps (LARS: whole-tensor norms) is told here."""
    _skip_the_shared_memory_inference_op()
    if settings is None:
        settings = OptimizerSettings(name="sgd", momentum=momentum, weight_decay=weight_decay,
                                     exclude_from_decay=False)
    optimizer = build_optimizer(settings, model, lr)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=ds_config, dist_init_required=False
    )
    base = getattr(optimizer, "optimizer", optimizer)
    if hasattr(base, "use_partitions"):
        base.use_partitions(optimizer_partitions(optimizer))
    create_initial_state(optimizer)  # every param group's state, before ZeRO-1/2 maps it after the first step
    return engine, optimizer


def engine_dtype(engine) -> torch.dtype:
    """The backbone's compute dtype, which the batch is cast to: bf16 for a bf16 engine and under
    ``torch_autocast`` (whose convolutions would cast an fp32 batch to bf16 again in the forward);
    fp16 engines are refused by ``load_deepspeed_config``."""
    if engine.fp16_enabled():
        raise ConfigError("the DeepSpeed engine runs fp16, which is not supported: enable bf16 in its config instead")
    if engine.torch_autocast_enabled():
        return engine.torch_autocast_dtype()
    return torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
