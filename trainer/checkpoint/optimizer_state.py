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

Every key the optimizer keeps moves, whatever the optimizer (``trainer.optim`` or torch's):
- state with the shape of what it is kept for (``momentum_buffer``, ``exp_avg``, ``exp_avg_sq``)
  is per element, assembled whole and put back into any partitioning;
- scalar state (AdamW's ``step``, which its bias correction reads) is per parameter.  Under ZeRO
  the optimizer keeps one per flat partition, shared by every parameter with a piece in it, so each
  parameter saves its partition's value and a load gives each partition the value of its
  parameters (``trainer.optim.partitions.state_owners`` finds a parameter's partition).
An optimizer with ``initial_state(tensor, group)`` creates its state through it before a load, so
each key lands where that optimizer keeps it (AdamW's fused ``step`` on the device).
"""

from __future__ import annotations

import torch

from trainer.optim import create_initial_state, optimizer_partitions, state_owners
from trainer.parallel.deepspeed_import import (
    safe_get_full_fp32_param,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)


def _partitioned(parameter: torch.nn.Parameter) -> bool:
    """DeepSpeed owns this parameter's fp32 state (ZeRO 1-3 or its bf16 optimizer)."""
    return hasattr(parameter, "ds_id") or hasattr(parameter, "_hp_mapping")


def _base_optimizer(engine) -> torch.optim.Optimizer:
    """The torch optimizer holding the state (DeepSpeed wraps it above stage 0)."""
    optimizer = engine.optimizer
    return getattr(optimizer, "optimizer", optimizer)


def _is_scalar(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) or (
        torch.is_tensor(value) and value.dim() == 0)


def state_keys(base: torch.optim.Optimizer) -> tuple[list[str], list[str]]:
    """(per-element keys, scalar keys) of the state ``base`` keeps, sorted: the same on every rank
    (the optimizer's type decides them), so every rank issues the same collectives.  A key is per
    element where its value has the shape of the (non-scalar) tensor it is kept for."""
    elements, scalars = set(), set()
    for owner, state in base.state.items():
        for key, value in state.items():
            if torch.is_tensor(value) and owner.dim() > 0 and value.shape == owner.shape:
                elements.add(key)
            elif _is_scalar(value):
                scalars.add(key)
    return sorted(elements), sorted(scalars - elements)


def fresh_host_copy(name: str, value: torch.Tensor) -> torch.Tensor:
    return value.detach().to("cpu", torch.float32, copy=True)


def full_optimizer_state(engine, keep: bool = True, host_copy=fresh_host_copy) -> dict[str, dict[str, torch.Tensor]]:
    """``{parameter name: {key: full fp32 state on the CPU}}`` (scalar state as 0-dim tensors).
    Collective under ZeRO: every rank calls it (each parameter's partitions are gathered in turn);
    ranks with ``keep`` False take part without copying the state to the CPU and get ``{}``.
    ``host_copy(name, value)`` makes each CPU copy of per-element state (a fresh one by default)."""
    base = _base_optimizer(engine)
    element_keys, scalar_keys = state_keys(base)
    owners = state_owners(engine.optimizer)
    state: dict[str, dict[str, torch.Tensor]] = {}
    for name, parameter in engine.module.named_parameters():
        owned = base.state.get(owners.get(parameter, parameter), {})
        for key in element_keys:
            value = safe_get_full_optimizer_state(parameter, key) if _partitioned(parameter) else owned.get(key)
            if value is not None and keep:
                state.setdefault(name, {})[key] = host_copy(f"{name}/{key}", value)
        for key in scalar_keys:
            if key in owned and keep:
                state.setdefault(name, {})[key] = torch.as_tensor(owned[key]).detach().to("cpu", copy=True)
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


def _materialize(engine, element_keys: set[str]) -> None:
    """Creates the (zero) state of an optimizer that has not stepped yet.

    Torch optimizers create their state at the first step and DeepSpeed maps parameters onto it
    only then; the state to load must go in before that step, so it is created here (through the
    optimizer's ``initial_state`` where it has one, else zeros for the per-element keys) and
    mapped."""
    optimizer = engine.optimizer
    if not create_initial_state(optimizer):
        partitions = optimizer_partitions(optimizer)
        if not partitions:
            return  # stage 0 in fp32 with a torch optimizer: the load sets each parameter's state
        base = _base_optimizer(engine)
        for partition in partitions:
            state = base.state[partition.tensor]
            for key in element_keys:
                state.setdefault(key, torch.zeros_like(partition.tensor))
    link = getattr(optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        link()


def _put(state: dict, key: str, value: torch.Tensor, like: torch.Tensor) -> None:
    """``state[key] = value``, into the tensor (or number) the optimizer already keeps there."""
    current = state.get(key)
    if torch.is_tensor(current):
        current.copy_(value)
    elif isinstance(current, (int, float)) and not isinstance(current, bool):
        state[key] = type(current)(value.item())
    elif value.dim() == 0:
        state[key] = value.clone()  # torch's own optimizers keep unfused scalars on the CPU
    else:
        state[key] = value.to(like.device, like.dtype).clone()


def load_full_optimizer_state(engine, state: dict[str, dict[str, torch.Tensor]]) -> list[str]:
    """Puts ``state`` into this run's partitioning, before its first step; returns the parameter
    names it had no state for (they start from zero state, as on a first step)."""
    _materialize(engine, {key for saved in state.values() for key, value in saved.items() if value.dim() > 0})
    base = _base_optimizer(engine)
    element_keys, scalar_keys = state_keys(base)
    owners = state_owners(engine.optimizer)
    missing = []
    for name, parameter in engine.module.named_parameters():
        saved = state.get(name)
        if saved is None:
            missing.append(name)
            continue
        owner = owners.get(parameter, parameter)
        full_shape = tuple(_full_shape(parameter))
        for key, value in saved.items():
            if key in scalar_keys or (key not in element_keys and value.dim() == 0 and full_shape != ()):
                _put(base.state.setdefault(owner, {}), key, value, owner)  # its partition's, under ZeRO
            elif tuple(value.shape) != full_shape:
                raise ValueError(f"optimizer state {key!r} of {name} has shape {tuple(value.shape)}, the parameter "
                                 f"{full_shape}: the checkpoint is of another model")
            elif _partitioned(parameter):
                _set_full(parameter, value.to(parameter.device), key)
            else:
                _put(base.state.setdefault(owner, {}), key, value, owner)
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
