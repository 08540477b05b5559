"""A DeepSpeed config file read and checked for this project's training: the ds_configs/ JSON with
the job's batch and gradient clipping filled in, and the settings this project does not train with
(fp16, gradients reduced in bf16) refused.

In the config layer (it only reads a file and raises ``ConfigError``), so the memory planner reads the
same settings the engine runs with; ``trainer.engine.deepspeed_setup`` hands the result to DeepSpeed."""

from __future__ import annotations

import json
from pathlib import Path

from trainer.config_building import ConfigError


def load_deepspeed_config(path: Path, micro_batch: int, clip_grad_norm: float = 0.0) -> dict:
    """Read a ds_configs/ JSON file, drop ``_comment`` keys, fill in the batch size and the
    gradient clipping of ``optim.clip_grad_norm`` (``apply_gradient_clipping``), and turn DeepSpeed's
    throughput timer off unless the file configures ``timers.throughput`` itself (a rule of
    ``host_reads_per_step`` then names its waits)."""
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
    _check_autocast(config.get("torch_autocast", {}), stage, path)
    if config.get("gradient_accumulation_steps", 1) != 1:
        raise ConfigError(f"{path}: gradient_accumulation_steps must be 1 (the classifier steps every batch)")
    config["train_micro_batch_size_per_gpu"] = micro_batch
    config.pop("train_batch_size", None)
    # DeepSpeed's throughput timer is on unless a config says otherwise, and synchronises the whole
    # device at its start (every forward) and stop (every step): off, unless the file asks for it
    timers = config.get("timers", {})
    if "throughput" not in timers:
        config["timers"] = {**timers, "throughput": {"enabled": False}}
    config.setdefault("zero_allow_untested_optimizer", True)  # SGD, LARS, AdamW: torch's or ours, not DeepSpeed's
    return apply_gradient_clipping(config, clip_grad_norm, path)


def _check_autocast(autocast: dict, stage: int, path: Path) -> None:
    """DeepSpeed's ``torch_autocast`` mode (fp32 weights and gradients, bf16 compute), as this project
    runs it: bf16 only, and no gradient all-reduced in bf16."""
    if not autocast.get("enabled", False):
        return
    if str(autocast.get("dtype", "bfloat16")).removeprefix("torch.") not in ("bfloat16", "bf16"):
        raise ConfigError(f"{path}: torch_autocast.dtype={autocast.get('dtype')!r} is not supported (fp16 needs a "
                          'loss scale that no objective unscales): use "dtype": "bfloat16"')
    if stage >= 1 and autocast.get("lower_precision_safe_modules") != []:
        raise ConfigError(f"{path}: torch_autocast.lower_precision_safe_modules must be [] at ZeRO stage {stage}: "
                          "ZeRO reduces the gradients of the modules it lists (by default Linear and Conv) in bf16, "
                          "and a bf16 sum over many ranks keeps 8 bits of mantissa; with [] every gradient is "
                          'averaged in fp32. Add "lower_precision_safe_modules": [], as ds_configs/'
                          "zero0_autocast_bf16.json has")


def apply_gradient_clipping(config: dict, clip_grad_norm: float, path: Path | str = "the DeepSpeed config") -> dict:
    """``config`` with DeepSpeed's ``gradient_clipping`` set from ``optim.clip_grad_norm`` (0: off).

    DeepSpeed clips from the global gradient norm it computes each step; with
    ``zero_optimization.compute_grad_norm: false`` it computes none and refuses clipping, so that
    pair is refused here, naming both fixes.  A clipping value in the DeepSpeed file itself must
    agree with the job config's (one place decides)."""
    in_file = float(config.get("gradient_clipping", 0.0) or 0.0)
    if clip_grad_norm and in_file and in_file != clip_grad_norm:
        raise ConfigError(f"optim.clip_grad_norm={clip_grad_norm} and gradient_clipping={in_file} in {path} disagree: "
                          "set the clipping in the job config (optim.clip_grad_norm) and 0 in the DeepSpeed config")
    clip = clip_grad_norm or in_file
    if clip and config.get("zero_optimization", {}).get("compute_grad_norm", True) is False:
        raise ConfigError(f"optim.clip_grad_norm={clip} needs the gradient norm, but {path} sets "
                          "zero_optimization.compute_grad_norm: false: remove that key (DeepSpeed then computes the "
                          "norm each step, one host sync) or set optim.clip_grad_norm: 0")
    return {**config, "gradient_clipping": clip}
