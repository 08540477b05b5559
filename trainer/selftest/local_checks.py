"""Self-test checks that run in this one process, on its device (the first GPU, or the CPU).

Each check exercises the code a training job runs (the compiled CO2 kernel, PIC's host row store
with its prefetch, the DALI loader) and returns a ``CheckResult``; an exception inside a check is
its failure, never the self-test's end.
"""

from __future__ import annotations

import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from trainer.selftest.report import FAIL, PASS, SKIPPED, CheckResult

NO_GPU = "needs a CUDA device"


def devices() -> CheckResult:
    from trainer.observability.what_runs import what_runs
    from trainer.parallel import single_process_dims

    facts = what_runs(single_process_dims())
    found = ", ".join(f"{name} {facts[name]}" for name in ("torch", "cuda", "nccl", "dali", "deepspeed"))
    if not torch.cuda.is_available():
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


def pic_host_store(device: torch.device) -> CheckResult:
    """Three PIC steps with W in host memory (pinned on GPUs) and the next step's rows prefetched
    in the background (a side stream on GPUs)."""
    from data_pipeline.loading.samplers.base import StepIndices
    from trainer.engine.schedule import set_lr
    from trainer.objectives import ObjectiveContext, OptimSettings, PicConfig, StepViews, View, build_objective
    from trainer.parallel import single_process_dims

    dims = single_process_dims(device)
    config = PicConfig(chunk_size=1024, queue_size=512, row_store="host", prefetch=True)
    context = ObjectiveContext(dims=dims, num_instances=20_000, feature_dim=128, seed=0,
                               optim=OptimSettings(momentum=0.9, weight_decay=1e-4))
    objective = build_objective(config, context)
    rng = np.random.default_rng(0)
    plans = [StepIndices(rng.choice(20_000, (1, 64), replace=False), np.ones((1, 64), dtype=bool)) for _ in range(4)]
    started, losses = time.perf_counter(), []
    for step in range(3):
        views = [View(torch.randn(64, 128, device=device, requires_grad=True), "global", v) for v in range(2)]
        ids = torch.from_numpy(plans[step].ids[0]).to(device)
        loss = objective.loss(StepViews(views, ids, torch.ones(64, dtype=torch.bool, device=device), 64, 0, step,
                                        plan=plans[step], next_plan=plans[step + 1])).loss
        loss.backward()
        objective.after_backward()
        for optimizer in objective.optimizers():
            set_lr(optimizer, 0.1)
            optimizer.step()
        losses.append(float(loss))
    objective.state_dict()  # waits for the last prefetch and brings every row up to date
    milliseconds = 1000 * (time.perf_counter() - started) / 3
    status = PASS if all(np.isfinite(losses)) else FAIL
    return CheckResult("PIC host store + prefetch", status, f"{milliseconds:.0f} ms/step",
                       "pinned rows, side stream" if device.type == "cuda" else "CPU rows, prefetch thread")


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


def host_syncs_per_step(device: torch.device) -> CheckResult:
    """Host syncs in one step of the sharded classifier, as CUDA's sync debug mode counts them."""
    if device.type != "cuda":
        return CheckResult("host syncs per step", SKIPPED, "", NO_GPU)
    from trainer.classifier import ClassifierConfig, ShardedCosineClassifier
    from trainer.parallel import single_process_dims

    classifier = ShardedCosineClassifier(ClassifierConfig(num_classes=100_000, validate_inputs=False, chunk_size=16384),
                                         single_process_dims(device))
    features = torch.randn(256, 128, device=device, requires_grad=True)
    ids = torch.randint(0, 100_000, (256,), device=device)
    classifier(features, ids).backward()  # warm-up: allocations and first launches
    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            classifier(features, ids).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message).lower()]
    return CheckResult("host syncs per step", PASS if not syncs else FAIL, f"{len(syncs)} syncs",
                       syncs[0] if syncs else "classifier forward + backward")
