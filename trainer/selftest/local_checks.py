"""Self-test checks that run in this one process, on its device (the first GPU, or the CPU).

Each check exercises the code a training job runs (the compiled CO2 kernel, PIC's host row store
with its prefetch, the DALI loader) and returns a ``CheckResult``; an exception inside a check is
its failure, never the self-test's end.
"""

from __future__ import annotations

import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from trainer.selftest.report import FAIL, PASS, CheckResult

NO_GPU = "needs a CUDA device"


def nvidia_devices_present(dev: Path = Path("/dev")) -> list[str]:
    """The NVIDIA GPU device files of this node (``/dev/nvidia0``...): the GPUs a pod was given,
    whether or not CUDA can use them."""
    return sorted(path.name for path in dev.glob("nvidia[0-9]*"))


def _why_cuda_cannot_start() -> str:
    try:
        torch.cuda.init()
    except Exception as error:  # noqa: BLE001 - its message is the finding
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return "torch.cuda.is_available() is false"


def devices() -> CheckResult:
    from trainer.observability.what_runs import what_runs
    from trainer.parallel import single_process_dims

    facts = what_runs(single_process_dims(torch.device("cpu")))
    found = ", ".join(f"{name} {facts[name]}" for name in ("torch", "cuda", "nccl", "dali", "deepspeed"))
    if not torch.cuda.is_available():
        if gpus := nvidia_devices_present():
            return CheckResult("devices", FAIL, f"{len(gpus)} NVIDIA devices, CUDA unusable",
                               f"/dev/{gpus[0]} is present but CUDA cannot start ({_why_cuda_cannot_start()}): "
                               f"check the driver and the CUDA build of torch ({found})")
        return CheckResult("devices", PASS, "CPU only", f"{found}; the GPU-only checks are skipped")
    names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
    return CheckResult("devices", PASS, f"{torch.cuda.device_count()} x {', '.join(names)}", found)


def compiled_co2(device: torch.device) -> CheckResult:
    """CO2's fused chunk functions compiled by inductor (Triton on GPUs) against the same code run eagerly."""
    from trainer.classifier.kernel.chunked import KernelSettings, sharded_cosine_ce_with_term
    from trainer.classifier.terms import co2_math as consistency_math
    from trainer.classifier.terms.co2 import ConsistencyTerm

    generator = torch.Generator().manual_seed(0)
    features = F.normalize(torch.randn(2 * 64, 128, generator=generator), dim=1).to(device)
    weight = torch.randn(5000, 128, generator=generator).to(device)
    targets = torch.randint(0, 5000, (64,), generator=generator).repeat(2)[:, None].to(device)
    outputs = []
    started = time.perf_counter()
    for compiled in (False, True):
        x, w = features.clone().requires_grad_(), weight.clone().requires_grad_()
        term = ConsistencyTerm.for_views(0.05, 0.3, ["global", "global"], compiled=compiled)
        loss, values = sharded_cosine_ce_with_term(x, w, targets, torch.ones(128, 1, device=device),
                                                   KernelSettings(temperature=0.15, chunk_size=2048), term, None)
        (loss.sum() + values.sum()).backward()
        outputs.append((loss, values, x.grad, w.grad))
    seconds = time.perf_counter() - started
    if any(function.fell_back for function in (consistency_math.fused_add_chunk_sums,
                                                consistency_math.fused_grad_logits)):
        return CheckResult("compiled CO2 kernel", FAIL, f"{seconds:.1f} s", "inductor could not compile it")
    error = max(float((a - b).abs().max()) for a, b in zip(*outputs))
    status = PASS if error < 1e-4 else FAIL
    return CheckResult("compiled CO2 kernel", status, f"max diff {error:.1e}", f"compiled vs eager, {seconds:.1f} s")


def _pic_steps(device: torch.device, row_store: str, prefetch: bool) -> tuple[list[float], torch.Tensor, float]:
    """Eight PIC steps of fixed inputs: their losses, every row (W, momentum) at the end, ms per step."""
    from data_pipeline.loading.samplers.base import StepIndices
    from trainer.engine.schedule import set_lr
    from trainer.objectives import ObjectiveContext, OptimSettings, PicConfig, StepViews, View, build_objective
    from trainer.parallel import single_process_dims

    dims = single_process_dims(device)
    config = PicConfig(chunk_size=1024, queue_size=256, row_store=row_store, prefetch=prefetch)
    context = ObjectiveContext(dims=dims, num_instances=20_000, feature_dim=128, seed=0,
                               optim=OptimSettings(momentum=0.9, weight_decay=1e-4))
    objective = build_objective(config, context)
    rng = np.random.default_rng(0)
    steps = 8  # the queue (256) is full after 4 steps of 64: later steps write rows back to the store
    plans = [StepIndices(rng.choice(20_000, (1, 64), replace=False), np.ones((1, 64), dtype=bool))
             for _ in range(steps + 1)]
    generator = torch.Generator().manual_seed(1)
    inputs = [[torch.randn(64, 128, generator=generator) for _ in range(2)] for _ in range(steps)]
    started, losses = time.perf_counter(), []
    for step in range(steps):
        views = [View(x.to(device).requires_grad_(), "global", v) for v, x in enumerate(inputs[step])]
        ids = torch.from_numpy(plans[step].ids[0]).to(device)
        loss = objective.loss(StepViews(views, ids, torch.ones(64, dtype=torch.bool, device=device), 64, 0, step,
                                        plan=plans[step], next_plan=plans[step + 1])).loss
        loss.backward()
        objective.after_backward()
        for optimizer in objective.optimizers():
            set_lr(optimizer, 0.1)
            optimizer.step()
        losses.append(float(loss.detach()))
    rows = objective.state_dict()["rows"].rows  # waits for the last prefetch, brings every row up to date
    return losses, rows.float().cpu(), 1000 * (time.perf_counter() - started) / steps


def pic_host_store(device: torch.device) -> CheckResult:
    """PIC with W in host memory (pinned on GPUs), rows written back and the next step's rows
    prefetched in the background (a side stream on GPUs), against the same steps with every row
    on the device and no prefetch: the same losses and the same rows at the end."""
    losses, rows, milliseconds = _pic_steps(device, "host", prefetch=True)
    expected_losses, expected_rows, _ = _pic_steps(device, "device", prefetch=False)
    loss_error = max(abs(a - b) for a, b in zip(losses, expected_losses))
    row_error = float((rows - expected_rows).abs().max())
    ok = loss_error <= 1e-6 and row_error <= 1e-6
    where = "pinned rows, side stream" if device.type == "cuda" else "CPU rows, prefetch thread"
    return CheckResult("PIC host store + prefetch", PASS if ok else FAIL, f"{milliseconds:.0f} ms/step",
                       f"{where}; vs rows on the device: loss diff {loss_error:.1e}, rows diff {row_error:.1e}")


def dali_decode(device: torch.device) -> CheckResult:
    """The DALI loader on the embedded digits (``mixed`` nvJPEG decode on GPUs, DALI's CPU decoder otherwise)."""
    from data_pipeline.ingest.make_shards import ShardSettings, write_shards
    from data_pipeline.ingest.sources.generated import sklearn_digits
    from data_pipeline.loading.loader import build_loader
    from data_pipeline.loading.loader_config import LoaderConfig

    with tempfile.TemporaryDirectory() as folder:
        shards = Path(folder) / "shards"
        write_shards(sklearn_digits(32, split="val"), shards, ShardSettings(samples_per_shard=200), progress=False)
        loader = build_loader(shards, LoaderConfig(backend="dali", batch_size=64), 0, 1, device, train=True)
        started, images = time.perf_counter(), 0
        for batch in loader.epoch_batches(0):
            if not all(torch.isfinite(view).all() and view.device.type == device.type for view in batch.views):
                return CheckResult("DALI decode", FAIL, "", "a view is not finite or not on the device")
            images += batch.instance_ids.numel()
        seconds = time.perf_counter() - started
    decoder = "mixed (nvJPEG)" if device.type == "cuda" else "cpu"
    return CheckResult("DALI decode", PASS, f"{images / seconds:.0f} images/s", f"{decoder}, {images} images")


def _objective_steps(objective, device: torch.device, ids_per_step: list[np.ndarray],
                     counted_from: int | None = None, found: list[str] | None = None, name: str = ""):
    """One step per ``ids_per_step`` entry (fixed random features, learning rate 0.1); the host syncs
    of the steps from ``counted_from`` on go to ``found`` as "name: source line" (CUDA's sync debug
    mode).  One call runs every step: an objective's steps only go forward, each with the next step's
    plan (PIC prefetches its rows)."""
    from data_pipeline.loading.samplers.base import StepIndices
    from trainer.dry_run.host_syncs import device_sync_sites

    plans = [StepIndices(ids[None, :], np.ones((1, ids.size), dtype=bool)) for ids in ids_per_step]
    sites: list[str] = []
    with ExitStack() as counting:
        for step, plan in enumerate(plans):
            if step == counted_from:
                torch.cuda.synchronize(device)
                sites = counting.enter_context(device_sync_sites())
            _objective_step(objective, device, plan, plans[min(step + 1, len(plans) - 1)], step)
    if found is not None:
        found += [f"{name}: {site}" for site in sites]


def _objective_step(objective, device: torch.device, plan, next_plan, step: int) -> None:
    """One step of ``plan`` on fixed random features at learning rate 0.1."""
    from trainer.engine.schedule import set_lr
    from trainer.objectives import StepViews, View

    views = [View(torch.randn(plan.ids.shape[1], 128, device=device, requires_grad=True), "global", v)
             for v in range(2)]
    ids = torch.from_numpy(plan.ids[0]).to(device, non_blocking=True)
    valid = torch.ones(plan.ids.shape[1], dtype=torch.bool, device=device)
    loss = objective.loss(StepViews(views, ids, valid, plan.ids.shape[1], 0, step, plan=plan,
                                    next_plan=next_plan)).loss
    loss.backward()
    objective.after_backward()
    for optimizer in objective.optimizers():
        set_lr(optimizer, 0.1)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _cluster_objectives(device: torch.device) -> dict:
    """The step settings the cluster configs use: top-K smoothing with CO2, and PIC with its host store."""
    from trainer.objectives import InstanceConfig, ObjectiveContext, OptimSettings, PicConfig, build_objective
    from trainer.parallel import single_process_dims

    context = ObjectiveContext(dims=single_process_dims(device), num_instances=100_000, feature_dim=128, seed=0,
                               optim=OptimSettings(momentum=0.9, weight_decay=1e-4))
    instance = build_objective(InstanceConfig(chunk_size=16384, top_k=10, smoothing_alpha=0.2, co2_alpha=0.3,
                                              contrastive_prior=False), context)
    instance.on_epoch_start(0)  # the hard-negative search (once per epoch, not a step)
    pic = build_objective(PicConfig(chunk_size=16384, queue_size=1024, row_store="host", prefetch=True,
                                    co2_alpha=0.3), context)
    return {"instance (top-K smoothing, CO2)": instance, "pic (host store, prefetch, CO2)": pic}


def host_syncs_per_step(device: torch.device) -> CheckResult:
    """Host syncs in the steps of the cluster configs' settings: on a GPU as CUDA's sync debug mode
    counts them (after warm-up steps that compile and allocate); without one, on fake CUDA devices
    by the dry run (``trainer.dry_run``), at small N on 2 simulated ranks."""
    if device.type != "cuda":
        return _host_syncs_on_fake_devices()
    rng = np.random.default_rng(0)
    found = []
    for name, objective in _cluster_objectives(device).items():
        batches = [rng.choice(100_000, 256, replace=False) for _ in range(8)]
        _objective_steps(objective, device, batches, counted_from=6, found=found, name=name)
    return CheckResult("host syncs per step", PASS if not found else FAIL, f"{len(found)} syncs",
                       found[0] if found else "instance with smoothing and CO2, PIC with its host store")


def _host_syncs_on_fake_devices() -> CheckResult:
    from trainer.config import JobConfig
    from trainer.config_building import build_dataclass
    from trainer.dry_run.job import dry_run_job

    found = []
    objectives = {
        "instance (top-K smoothing, CO2)": {"name": "instance", "top_k": 10, "smoothing_alpha": 0.2, "co2_alpha": 0.3,
                                            "contrastive_prior": False, "chunk_size": 4096},
        "pic (host store, prefetch, CO2)": {"name": "pic", "queue_size": 512, "row_store": "host", "prefetch": True,
                                            "co2_alpha": 0.3, "chunk_size": 4096},
    }
    for name, objective in objectives.items():
        config = build_dataclass(JobConfig, {"data": {"train_shards": "(fake)", "loader": {"batch_size": 128}},
                                             "objective": objective, "parallel": {"device": "cuda"}}, "")
        result = dry_run_job(config, 20_000, world_size=2, steps=4)
        found += [f"{name}: {text}" for text in result.stopped.values()]
        found += [f"{name}: {sync}" for sync in result.step_syncs()]
    return CheckResult("host syncs per step", PASS if not found else FAIL, f"{len(found)} syncs (fake CUDA)",
                       found[0] if found else "no GPU: the dry run's count on fake CUDA devices; instance with "
                       "smoothing and CO2, PIC with its host store")
