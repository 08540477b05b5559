"""The DeepSpeed engine (backbone + head and its optimizer) as a checkpoint entry.

DeepSpeed writes its own files (``deepspeed/``, every rank), so the engine is a
``DirectoryState``.  Its snapshot runs DeepSpeed's save with a stand-in checkpoint engine that
keeps each file's state instead of writing it; the writer thread writes them later, from host
copies, through DeepSpeed's own checkpoint engine.  Next to them rank 0 writes ``model.pt`` (the
consolidated fp32 weights: DeepSpeed's fp32 master copy where it keeps one, never the bf16 module
copy) and ``optimizer.pt`` (the optimizer's state by parameter name, whole).  With the same world
size the DeepSpeed state restores the backbone exactly; with another, the weights come from
``model.pt`` and the optimizer state (SGD's momentum) from ``optimizer.pt``, put into the new ZeRO
partitioning by DeepSpeed's accessors (``trainer.checkpoint.optimizer_state``).

Why this state does not go through ``torch.distributed.checkpoint`` as the classifier rows do:
only DeepSpeed's ``load_checkpoint`` restores its engine exactly (partitions, counters, its bf16
optimizer), and only from its own files; a change of world size is already served by the
consolidated files and DeepSpeed's public accessors.  Saving ZeRO's partitions as DCP chunks
would need DeepSpeed's private fragment maps (``_hp_mapping``; ZeRO-3's padded ``ds_tensor``
partitions), stage by stage.  The price kept: gathering ``model.pt`` and ``optimizer.pt`` on rank 0
is part of the step's stall (for ResNet-50, ~100 MB per fp32 copy).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from torch import nn

from trainer.checkpoint.checkpoint_files import MODEL_FILE, OPTIMIZER_FILE, load_model_weights, read_trainer_meta
from trainer.checkpoint.optimizer_state import (
    fresh_host_copy,
    full_master_weights,
    full_optimizer_state,
    load_full_optimizer_state,
    load_master_weights,
)
from trainer.checkpoint.safe_load import load_data, refuse_pickled_code
from trainer.checkpoint.save_plan import FailPoint, FileWrite, HostBuffers, SavePlan
from trainer.checkpoint.write_retry import save_torch_file
from trainer.failpoints import fail_point
from trainer.parallel import ParallelDims
from trainer.parallel.deepspeed_import import CheckpointEngine, TorchCheckpointEngine, deepspeed

DEEPSPEED_FOLDER = "deepspeed"


class _CapturedFiles(CheckpointEngine):
    """Stands in for the engine's checkpoint engine while DeepSpeed saves: each file DeepSpeed would
    write becomes a ``FileWrite`` (written later, by the real checkpoint engine, from a snapshot)."""

    def __init__(self, real: CheckpointEngine, root: Path) -> None:
        super().__init__()
        self.real, self.root, self.files = real, Path(root), []

    def create(self, info) -> None:
        pass

    def save(self, state_dict, path: str) -> None:
        self.files.append(FileWrite(str(Path(path).relative_to(self.root)), state_dict, save=self._writer()))

    def _writer(self):
        """DeepSpeed's default engine's ``torch.save``, in its format, through ``save_torch_file``: a
        failed write then keeps its errno, and a transient one is tried again; others as they are."""
        if type(self.real) is TorchCheckpointEngine:
            return partial(save_torch_file, zipfile=bool(self.real.zipfile_serialization))
        return self.real.save

    def makedirs(self, path, exist_ok=False) -> None:
        self.real.makedirs(path, exist_ok=exist_ok)

    def load(self, path: str, map_location=None):
        return self.real.load(path, map_location)

    def commit(self, info) -> bool:
        return True


class EngineState:
    """The checkpoint entry of a DeepSpeed engine; ``log`` reports how a resharded resume went.
    ``network_statistics()``, when given, returns the BatchNorm statistics ``model.pt`` holds in
    place of the module's own (their average over the ranks: ``trainer.parallel.batch_norm``)."""

    def __init__(self, engine, log=print, network_statistics=None) -> None:
        self.engine, self.log, self.network_statistics = engine, log, network_statistics
        self.buffers = HostBuffers()  # rank 0's consolidated copies, reused save after save

    def snapshot(self, path: Path, dims: ParallelDims, step: int) -> SavePlan:
        """Collective (DeepSpeed's save, and the optimizer state gathered under ZeRO): DeepSpeed's
        files as it would write them, then (rank 0) ``model.pt`` and ``optimizer.pt``."""
        engine, path = self.engine, Path(path)
        fail_point("checkpoint.before_engine", step)
        real = engine.checkpoint_engine
        engine.checkpoint_engine = captured = _CapturedFiles(real, path)
        try:
            engine.save_checkpoint(str(path / DEEPSPEED_FOLDER), tag="state", save_latest=False)
        finally:
            engine.checkpoint_engine = real
        plan: SavePlan = [*captured.files, FailPoint("checkpoint.after_engine")]
        overrides = self.network_statistics() if self.network_statistics is not None else None
        weights = consolidated_weights(engine, dims.rank == 0, self.buffers.copy, overrides)  # collective under ZeRO
        if dims.rank == 0:
            plan.append(FileWrite(MODEL_FILE, weights, owned=True))
        optimizer_state = full_optimizer_state(engine, dims.rank == 0,  # collective under ZeRO
                                               lambda name, v: self.buffers.copy(f"optimizer/{name}", v))
        if dims.rank == 0:
            plan.append(FileWrite(OPTIMIZER_FILE, optimizer_state, owned=True))
        return plan

    def load_from(self, path: Path, dims: ParallelDims) -> None:
        load_engine(path, self.engine, dims, self.log)


def consolidated_weights(engine, keep: bool, host_copy, overrides: dict | None = None) -> dict:
    """The network as ``model.pt`` holds it, one CPU copy per entry: DeepSpeed's fp32 master of
    every parameter it keeps one of, the module's own values for the rest (buffers, and parameters
    below ZeRO in fp32), except the entries ``overrides`` gives (the BatchNorm statistics averaged
    over the ranks).  Collective under ZeRO (masters and ZeRO-3 partitions are gathered); ranks
    with ``keep`` False take part and get ``{}``.  ``host_copy(name, tensor)`` makes each copy.

    What a checkpoint saves and what the trainer's evaluation scores both come from here, so the
    network scored during training is the one ``instcls eval`` loads."""
    masters = full_master_weights(engine, keep, lambda name, v: host_copy(f"master/{name}", v))
    parameters = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(parameters, modifier_rank=None):  # no-op below ZeRO-3
        if not keep:
            return {}
        overrides = overrides or {}
        module = {k: host_copy(f"module/{k}", overrides.get(k, v)) for k, v in engine.module.state_dict().items()
                  if k not in masters}
    return {**module, **masters}


def plain_model_from_engine(engine, fresh_model: nn.Module, overrides: dict | None = None) -> nn.Module:
    """``fresh_model`` (same architecture) loaded with the engine's network as ``model.pt`` would
    hold it now (fp32 masters, not the bf16 module copy; ``overrides`` as in
    ``consolidated_weights``), on every rank.  Collective under ZeRO."""
    fresh_model.load_state_dict(consolidated_weights(engine, True, fresh_host_copy, overrides))
    return fresh_model


def load_engine(path: Path, engine, dims: ParallelDims, log=print) -> None:
    """The backbone: exact DeepSpeed state on the same world size, else the weights of model.pt."""
    path = Path(path)
    meta = read_trainer_meta(path)
    if meta["world_size"] == dims.world_size:
        refuse_pickled_code(path / DEEPSPEED_FOLDER)  # DeepSpeed unpickles with weights_only=False
        engine.load_checkpoint(str(path / DEEPSPEED_FOLDER), tag="state", load_lr_scheduler_states=False)
        return
    state_dict = load_model_weights(path)
    parameters = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(parameters, modifier_rank=0):
        if dims.rank == 0 or engine.zero_optimization_stage() < 3:
            engine.module.load_state_dict(state_dict)
    load_master_weights(engine, state_dict)  # else the first step writes the old master weights back
    optimizer_file = path / OPTIMIZER_FILE
    if not optimizer_file.is_file():  # written before optimizer.pt existed
        log(f"resuming {path} written by {meta['world_size']} ranks on {dims.world_size}: objective state re-split "
            f"by rows; backbone weights from model.pt; it has no {OPTIMIZER_FILE}, so the backbone optimizer's "
            "state restarts")
        return
    missing = load_full_optimizer_state(engine, load_data(optimizer_file, map_location="cpu"))
    log(f"resuming {path} written by {meta['world_size']} ranks on {dims.world_size}: objective state re-split by "
        f"rows; backbone weights from model.pt and optimizer state from {OPTIMIZER_FILE}"
        + (f" ({len(missing)} parameters had none: {', '.join(missing[:3])}...)" if missing else ""))
