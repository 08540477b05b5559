"""The backbone optimizer's state by parameter name, whole: what survives a change of world size.

Two things live in the optimizer, not the module: the per-parameter state, and under DeepSpeed
(ZeRO 1-3, the bf16 optimizer) the fp32 master weights, from which every step rewrites the
module's parameters.  Loading weights into the module alone is undone by the next step, so both go
through DeepSpeed's accessors.

ZeRO partitions the optimizer state (SGD's momentum, Adam's moments) by data-parallel rank, so the
DeepSpeed checkpoint of T ranks cannot be loaded on T' ranks.  DeepSpeed's own accessors
(``safe_get_full_optimizer_state`` / ``safe_set_full_optimizer_state``) assemble one parameter's
full fp32 state from the partitions and write it back into any partitioning; they cover ZeRO
1-3 and the bf16 optimizer.  Below ZeRO (stage 0 in fp32) the state is the torch optimizer's own,
per parameter.  Saving consolidates every parameter's state into one file (like ``model.pt`` for
the weights), loading puts it into this run's partitioning.

Only tensor state with the parameter's shape moves (``momentum_buffer``, ``exp_avg``,
``exp_avg_sq``); scalar counters such as Adam's ``step`` live in the optimizer's param groups
under ZeRO and are not per parameter.
"""

from __future__ import annotations

import torch

from trainer.parallel.deepspeed_import import (
    safe_get_full_fp32_param,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)

# Per-parameter tensors of the torch optimizers a backbone may use, in a fixed order so that every
# rank issues the same collectives.
STATE_KEYS = ("momentum_buffer", "exp_avg", "exp_avg_sq")


def _partitioned(parameter: torch.nn.Parameter) -> bool:
    """DeepSpeed owns this parameter's fp32 state (ZeRO 1-3 or its bf16 optimizer)."""
    return hasattr(parameter, "ds_id") or hasattr(parameter, "_hp_mapping")


def _base_optimizer(engine) -> torch.optim.Optimizer:
    """The torch optimizer holding the state (DeepSpeed wraps it above stage 0)."""
    optimizer = engine.optimizer
    return getattr(optimizer, "optimizer", optimizer)


def _keys_present(engine) -> list[str]:
    """The state keys this optimizer has, the same on every rank (its type decides them)."""
    base = _base_optimizer(engine)
    present = {key for state in base.state.values() for key, value in state.items() if torch.is_tensor(value)}
    return [key for key in STATE_KEYS if key in present]


def fresh_host_copy(name: str, value: torch.Tensor) -> torch.Tensor:
    return value.detach().to("cpu", torch.float32, copy=True)


def full_optimizer_state(engine, keep: bool = True, host_copy=fresh_host_copy) -> dict[str, dict[str, torch.Tensor]]:
    """``{parameter name: {key: full fp32 state on the CPU}}``.  Collective under ZeRO: every rank
    calls it (each parameter's partitions are gathered in turn); ranks with ``keep`` False take
    part without copying the state to the CPU and get ``{}``.  ``host_copy(name, value)`` makes
    each CPU copy (a fresh one by default)."""
    keys = _keys_present(engine)
    base = _base_optimizer(engine)
    state: dict[str, dict[str, torch.Tensor]] = {}
    for name, parameter in engine.module.named_parameters():
        for key in keys:
            if _partitioned(parameter):
                value = safe_get_full_optimizer_state(parameter, key)
            else:
                value = base.state.get(parameter, {}).get(key)
            if value is not None and keep:
                state.setdefault(name, {})[key] = host_copy(f"{name}/{key}", value)
    return state


def full_master_weights(engine, keep: bool = True, host_copy=fresh_host_copy) -> dict[str, torch.Tensor]:
    """``{parameter name: full fp32 master weight on the CPU}`` of every parameter DeepSpeed owns.

    Under a bf16 config the module holds bf16 copies, rounded from these at every step: a
    checkpoint of the module's weights would resume (on another world size) from rounded masters.
    Collective under ZeRO like ``full_optimizer_state``; ``keep`` False ranks get ``{}``."""
    weights: dict[str, torch.Tensor] = {}
    for name, parameter in engine.module.named_parameters():
        if _partitioned(parameter):
            value = safe_get_full_fp32_param(parameter)
            if keep:
                weights[name] = host_copy(name, value)
    return weights


# Where DeepSpeed keeps its flat fp32 partitions, whose optimizer state the parameters map into.
_FLAT_PARTITIONS = ("single_partition_of_fp32_groups",  # ZeRO 1-2
                    "fp32_partitioned_groups_flat",  # ZeRO 3
                    "fp32_groups_flat_partition")  # the bf16 optimizer


def _materialize(engine, keys: set[str]) -> None:
    """Creates the (zero) state of a DeepSpeed optimizer that has not stepped yet.

    Torch optimizers create their state at the first step and DeepSpeed maps parameters onto it
    only then; the state to load must go in before that step, so it is created here and mapped."""
    optimizer = engine.optimizer
    for attribute in _FLAT_PARTITIONS:
        partitions = getattr(optimizer, attribute, None)
        if partitions:
            break
    else:
        return  # stage 0 in fp32: the torch optimizer's state is per parameter
    for partition in partitions:
        state = optimizer.optimizer.state[partition]
        for key in keys:
            state.setdefault(key, torch.zeros_like(partition))
    link = getattr(optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        link()


def load_full_optimizer_state(engine, state: dict[str, dict[str, torch.Tensor]]) -> list[str]:
    """Puts ``state`` into this run's partitioning, before its first step; returns the parameter
    names it had no state for (they start from zero state, as on a first step)."""
    _materialize(engine, {key for saved in state.values() for key in saved})
    base = _base_optimizer(engine)
    missing = []
    for name, parameter in engine.module.named_parameters():
        saved = state.get(name)
        if saved is None:
            missing.append(name)
            continue
        for key, value in saved.items():
            if tuple(value.shape) != tuple(_full_shape(parameter)):
                raise ValueError(f"optimizer state {key!r} of {name} has shape {tuple(value.shape)}, the parameter "
                                 f"{tuple(_full_shape(parameter))}: the checkpoint is of another model")
            if _partitioned(parameter):
                _set_full(parameter, value.to(parameter.device), key)
            else:
                base.state.setdefault(parameter, {})[key] = value.to(parameter.device, parameter.dtype).clone()
    return missing


def _full_shape(parameter: torch.nn.Parameter) -> torch.Size:
    """The parameter's shape, also under ZeRO-3 where the local tensor is an empty placeholder."""
    return getattr(parameter, "ds_shape", parameter.shape)


def load_master_weights(engine, state_dict: dict[str, torch.Tensor]) -> None:
    """Sets DeepSpeed's fp32 master copy of every parameter it partitions to ``state_dict``'s value
    (the module's own parameters are loaded separately); a no-op at stage 0 in fp32."""
    for name, parameter in engine.module.named_parameters():
        if _partitioned(parameter):
            _set_full(parameter, state_dict[name].to(parameter.device, torch.float32), None)


def _set_full(parameter: torch.nn.Parameter, value: torch.Tensor, key: str | None) -> None:
    """DeepSpeed's setter of a parameter's full fp32 weight (``key`` None) or optimizer state.

    Its ZeRO-3 setter reads each rank's slice of ``value`` at the padded partition size, which runs
    past the end on the last rank when the size does not divide by the ranks; that slice is written
    here instead, zero-padded as ZeRO-3 pads it."""
    optimizer = getattr(parameter, "_z3_optimizer", None)
    if optimizer is not None:
        target, _ = optimizer._get_fp32_opt_state_partition(parameter, release_swap_buffers=False,
                                                            optim_state_key=key)
        start = target.numel() * optimizer._get_param_partition_rank(parameter)
        if start + target.numel() > value.numel():
            piece = value.flatten()[start:]
            with torch.no_grad():  # the fp32 partition is a leaf the optimizer steps
                target.zero_()
                target[: piece.numel()].copy_(piece)
            return
    if key is None:
        safe_set_full_fp32_param(parameter, value)
    else:
        safe_set_full_optimizer_state(parameter, value, key)
