"""The backbone + head through ``deepspeed.initialize`` with a ZeRO config from ds_configs/."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from trainer.config import ConfigError
from trainer.parallel.deepspeed_import import deepspeed


def load_deepspeed_config(path: Path, micro_batch: int) -> dict:
    """Read a ds_configs/ JSON file, drop ``_comment`` keys and fill in the batch size."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"deepspeed_config {path} not found; name a shipped one (zero{{0,1,2,3}}[_bf16]) or a file "
                          "of your own")
    try:
        config = {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}
    except json.JSONDecodeError as error:
        raise ConfigError(f"deepspeed_config {path} is not valid JSON: {error}") from error
    stage = config.get("zero_optimization", {}).get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"{path}: zero_optimization.stage={stage!r} is invalid; use 0, 1, 2 or 3")
    for section in ("fp16", "amp"):
        if config.get(section, {}).get("enabled", False):
            # fp16 runs a dynamic loss scale over the whole loss: it would scale the classifier
            # weight's gradient too (stepped by the objective's own optimizer, outside ZeRO), which
            # nothing unscales; and fp16 logits/features overflow where bf16 ones do not.
            raise ConfigError(f"{path}: {section}.enabled is true, but fp16 training is not supported (its loss "
                              f"scale would also scale the classifier's gradient, which no objective unscales); "
                              f'use bf16: set "{section}": {{"enabled": false}} and "bf16": {{"enabled": true}}, '
                              f"as in ds_configs/zero{stage}_bf16.json")
    if config.get("gradient_accumulation_steps", 1) != 1:
        raise ConfigError(f"{path}: gradient_accumulation_steps must be 1 (the classifier steps every batch)")
    config["train_micro_batch_size_per_gpu"] = micro_batch
    config.pop("train_batch_size", None)
    config.setdefault("zero_allow_untested_optimizer", True)  # plain SGD is what the paper uses
    return config


def _skip_the_shared_memory_inference_op() -> None:
    """DeepSpeed's CPU backend compiles a shared-memory all-reduce (``deepspeed_shm_comm``) with the
    machine's C++ compiler when it first starts: 25-75 s where ``TORCH_EXTENSIONS_DIR`` is empty (every
    new pod), a lock file that stalls later runs if a build is killed, and it serves only
    ``inference_all_reduce``, which training never calls.  Marked incompatible, DeepSpeed sends every
    collective through torch.distributed (gloo here), as it does on GPUs."""
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def initialize_backbone(model: nn.Module, ds_config: dict, lr: float, momentum: float, weight_decay: float):
    """``(engine, optimizer)``; DeepSpeed averages the backbone gradients over all ranks."""
    _skip_the_shared_memory_inference_op()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=ds_config, dist_init_required=False
    )
    return engine, optimizer


def engine_dtype(engine) -> torch.dtype:
    """The backbone's compute dtype; fp16 engines are refused by ``load_deepspeed_config``."""
    if engine.fp16_enabled():
        raise ConfigError("the DeepSpeed engine runs fp16, which is not supported: enable bf16 in its config instead")
    return torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
