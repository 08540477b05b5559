"""The plain PyTorch step that `instcls bench step --baseline` runs beside the job's own.

The same as the job: the network (``build_model`` of the job's ``ModelConfig``, its BatchNorm mode,
``model.compile``), the ranks and their process group, the per-rank batch and its views, run
through the network as the trainer runs them (views of one size concatenated into one forward,
the cast and layout of ``model_input``, so ``model.channels_last`` too), and the optimizer (the
registry's, from the job's ``optim`` section, at the job's peak learning rate).

Plain: torch's ``DistributedDataParallel`` instead of DeepSpeed's engine; torch's fastest kernels
for torch's optimizers (fused on CUDA, foreach elsewhere; LARS, the project's own, as it is); and
no instance classifier.  The loss is a stand-in, the mean square of each view's head features: it
sends a gradient through the whole network and costs next to nothing.  Leaving the classifier out
is the point: the job's images/s over this one prices the objective and whatever the trainer and
DeepSpeed add to the network's own step.

Precision, as DeepSpeed's engine computes (``engine_precision``): under a bf16 DeepSpeed config the
engine casts the module's parameters to bf16 (buffers stay fp32) and steps fp32 master weights.
So does the baseline: bf16 parameters in the forward and backward, gradients all-reduced in the
config's ``communication_data_type`` (fp32 in ds_configs/*_bf16.json), copied into fp32 masters
that the optimizer steps, and the masters copied back.  Not ``torch.autocast`` there: autocast runs
bf16 matmuls from fp32 parameters and keeps other ops in fp32, which is not what that engine runs.
Under DeepSpeed's ``torch_autocast`` (ds_configs/zero0_autocast_bf16.json) the engine does exactly
that, fp32 weights and gradients with the module's forward under ``torch.autocast``, and so does
the baseline.  The batch is cast as the trainer casts it (``engine_dtype``: bf16 in both modes).
"""

from __future__ import annotations

import copy
import inspect
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from trainer.bench.step_instruments import InstrumentedPhases, StepInstruments
from trainer.checkpoint.rng_state import reseed
from trainer.config import JobConfig
from trainer.engine.schedule import scaled_lr
from trainer.models import build_model
from trainer.models.backbone import model_input
from trainer.observability.step_phases import StepPhases
from trainer.optim import build_optimizer
from trainer.parallel import ParallelDims
from trainer.parallel.batch_norm import apply_batch_norm_mode, batch_norm_group

BASELINE_PHASES = ("forward", "objective", "backward", "optimizer")  # objective: the stand-in loss


def with_fastest_kernels(optimizer: torch.optim.Optimizer, device: torch.device) -> torch.optim.Optimizer:
    """``optimizer`` rebuilt on torch's fused kernel (CUDA) or foreach kernels (elsewhere) when it is
    one of torch's (it has both switches); one already fused, or one of ours (LARS), as it is."""
    defaults = optimizer.defaults
    if "foreach" not in defaults or "fused" not in defaults or defaults["fused"]:
        return optimizer
    fused = device.type == "cuda" and device.type in _get_fused_kernels_supported_devices()
    switches = dict(fused=True, foreach=False) if fused else dict(fused=False, foreach=True)
    groups = [{**group, **switches} for group in optimizer.param_groups]
    accepted = inspect.signature(type(optimizer)).parameters  # defaults may hold keys __init__ sets itself
    return type(optimizer)(groups, **{k: v for k, v in {**defaults, **switches}.items() if k in accepted})


def engine_precision(ds_config: dict) -> str:
    """What DeepSpeed's engine computes in under ``ds_config``: "autocast" (fp32 weights, the forward
    under ``torch.autocast`` in bf16), "bf16" (bf16 weights, fp32 masters) or "fp32"."""
    if ds_config.get("torch_autocast", {}).get("enabled", False):
        return "autocast"
    return "bf16" if ds_config.get("bf16", {}).get("enabled", False) else "fp32"


def _reduce_in_fp32(process_group, bucket):
    """DDP communication hook: the ``dist.GradBucket``'s average computed in fp32, written back in
    its dtype (a future of the bucket).  Unannotated: DDP checks annotations against the classes,
    and this module's are strings."""
    gradients = bucket.buffer()
    wide = gradients.float().div_(dist.get_world_size(process_group))
    work = dist.all_reduce(wide, group=process_group, async_op=True)
    return work.get_future().then(lambda future: gradients.copy_(future.value()[0]))


def _no_buffer_sync() -> dict:
    """DDP's switch that stops it broadcasting rank 0's buffers before every forward: newer torch
    names it ``forward_sync_buffers`` (and warns about the old name), older only ``broadcast_buffers``."""
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters:
        return dict(forward_sync_buffers=False)
    return dict(broadcast_buffers=False)


class PlainStep:
    """The baseline's network, data parallelism and optimizer on this rank; ``run`` trains."""

    def __init__(self, config: JobConfig, dims: ParallelDims, ds_config: dict) -> None:
        self.config, self.dims = config, dims
        device = dims.device
        self.precision = engine_precision(ds_config)
        bf16 = self.precision == "bf16"
        self.dtype = torch.float32 if self.precision == "fp32" else torch.bfloat16  # the batch's, engine_dtype's
        reseed(config.seed, 0, 0)  # the trainer's initial network
        model = build_model(config.model)
        group = batch_norm_group(config.model.batch_norm, config.model.sync_batch_norm_group, dims)
        model = apply_batch_norm_mode(model, config.model.batch_norm, group,
                                      config.parallel.collectives_over_one_rank).to(device)
        lr = scaled_lr(config.optim.base_lr, config.optim.base_batch, config.data.loader.batch_size * dims.world_size)
        stepped = model
        self.masters: list[torch.Tensor] = []
        if bf16:
            stepped = copy.deepcopy(model)  # fp32 masters, in the module's structure (the registry's groups)
            for parameter in model.parameters():
                parameter.data = parameter.data.to(torch.bfloat16)
            self.masters = list(stepped.parameters())
            for master in self.masters:
                master.grad = torch.zeros_like(master)
        self.parameters = list(model.parameters())
        self.optimizer = with_fastest_kernels(build_optimizer(config.optim.optimizer_settings(), stepped, lr, device),
                                              device)
        if config.model.compile:
            model.compile()
        self.model: nn.Module = model
        self.network: nn.Module = model
        if dims.is_distributed and dist.is_initialized():
            # BatchNorm statistics stay each rank's own (model.batch_norm local), as under DeepSpeed,
            # which broadcasts no buffers either
            self.network = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                                   process_group=dims.data_parallel_group, **_no_buffer_sync())
            if bf16 and ds_config.get("communication_data_type") in ("fp32", "float32"):
                self.network.register_comm_hook(dims.data_parallel_group, _reduce_in_fp32)

    @torch.no_grad()
    def _optimizer_step(self) -> None:
        if self.masters:
            torch._foreach_copy_([m.grad for m in self.masters], [p.grad for p in self.parameters])
            self.optimizer.step()
            torch._foreach_copy_(self.parameters, self.masters)
        else:
            self.optimizer.step()
        self.model.zero_grad(set_to_none=True)

    def run(self, views: list[torch.Tensor], steps: int, measured: range,
            instruments: StepInstruments) -> tuple[list[dict], list[dict]]:
        """``steps`` steps on ``views`` (the same every step); each step's images and seconds, and
        each step's seconds per phase (``StepPhases``).  On CUDA the device is synchronized before
        the first and after the last ``measured`` step, so their seconds add up to the time the
        device took."""
        device, layout = self.dims.device, self._forward_groups()
        phases = InstrumentedPhases(StepPhases(device), instruments)
        history, phase_history = [], []
        self.network.train()
        for step in range(steps):
            instruments.step_starts()
            if device.type == "cuda" and step == measured.start:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            phases.begin()
            batches = [model_input(torch.cat([views[i] for i in indices]), self.dtype, self.config.model)
                       for indices in layout]
            with self._autocast():  # one call for every crop size, as the trainer's engine gets them
                outputs = self.network(batches)
            features = [view for indices, output in zip(layout, outputs) for view in output.chunk(len(indices))]
            phases.end("forward")
            # The stand-in for the objective: no classifier, on purpose (see the module's docstring)
            loss = sum(view.float().pow(2).mean() for view in features)
            phases.end("objective")
            loss.backward()
            phases.end("backward")
            self._optimizer_step()
            phases.end("optimizer")
            phases.finish()
            if device.type == "cuda" and step == measured.stop - 1:
                torch.cuda.synchronize(device)
            history.append(dict(images=views[0].shape[0], data_wait=0.0, step=time.perf_counter() - start))
            phase_history.extend(phases.completed())
            instruments.step_ends()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            phase_history.extend(phases.completed())
        return history, phase_history

    def _autocast(self):
        if self.precision != "autocast":
            return nullcontext()
        return torch.autocast(self.dims.device.type, dtype=torch.bfloat16)

    def _forward_groups(self) -> list[list[int]]:
        return self.config.data.loader.view_layout.forward_groups()
