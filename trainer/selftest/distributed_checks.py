"""Self-test checks across every local device: one spawned rank per visible GPU (NCCL), or two CPU
ranks (gloo) where there is none.

Every rank writes its own results (``rank-R.json``, after each check): a check that fails on one
rank only must fail the self-test, whichever rank it is.  A rank whose check raised stops there:
its peers, waiting for it in that check's collectives, then fail too (the peer's connection
closes, or the process group's timeout ends the wait) instead of hanging, and the runner reports
the rank that failed first."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainer.selftest.report import FAIL, PASS, SKIPPED, CheckResult

TIMEOUT_ENV = "INSTCLS_SELFTEST_TIMEOUT_S"  # how long a rank waits in a collective for a failed peer


def check_name(check) -> str:
    """The row's name: the check's ``row_name``, or its function name in words."""
    return getattr(check, "row_name", check.__name__.replace("_", " "))


def worker(result_dir: str, checks=None) -> None:
    """One rank: the distributed checks in turn, each failure caught and reported as its result."""
    from trainer.parallel import init_distributed

    dims = init_distributed(timeout_s=float(os.environ.get(TIMEOUT_ENV, 120)))
    results = []
    path = Path(result_dir, f"rank-{dims.rank}.json")
    for check in checks or DISTRIBUTED_CHECKS:
        try:
            result = check(dims)
            dist.barrier()  # the ranks end each check together
            failed = False
        except Exception as error:  # noqa: BLE001 - a failed check is a row of the table, not the end
            result = CheckResult(check_name(check), FAIL, "", f"{type(error).__name__}: {error}")
            failed = True
        results.append(replace(result, at=time.time()))
        path.write_text(json.dumps([asdict(result) for result in results]))
        if failed:  # its peers may be inside this check's collectives: they fail on their own, not hang
            os._exit(0)


def collectives(dims) -> CheckResult:
    """All-reduce, all-gather and reduce-scatter give exact results; the all-reduce's bus bandwidth."""
    world, rank, device = dims.world_size, dims.rank, dims.device
    value = torch.full((1024,), float(rank + 1), device=device)
    dist.all_reduce(value)
    gathered = [torch.empty(4, device=device) for _ in range(world)]
    dist.all_gather(gathered, torch.full((4,), float(rank), device=device))
    scattered = torch.empty(4, device=device)
    dist.reduce_scatter(scattered, [torch.full((4,), float(r), device=device) for r in range(world)])
    exact = (
        bool((value == world * (world + 1) / 2).all())
        and all(bool((g == r).all()) for r, g in enumerate(gathered))
        and bool((scattered == rank * world).all())
    )
    size = (256 << 20) if device.type == "cuda" else (16 << 20)  # bytes
    payload = torch.ones(size // 4, device=device)
    dist.all_reduce(payload)  # warm-up
    started = time.perf_counter()
    dist.all_reduce(payload)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    bus = 2 * (world - 1) / world * size / seconds / 1e9  # the ring's bytes per link, as nccl-tests reports
    return CheckResult(
        "collectives",
        PASS if exact else FAIL,
        f"{bus:.1f} GB/s bus",
        f"{dims.backend}, {world} ranks" + ("" if exact else "; wrong results"),
    )


def sharded_classifier(dims) -> CheckResult:
    """The class-sharded loss and its gradient against ``F.cross_entropy`` over the full matrix, in
    fp32 and with bf16 features, over several chunks per rank (the chunk loop's boundaries)."""
    from trainer.classifier.kernel.chunked import KernelSettings, sharded_cosine_ce
    from trainer.classifier.sharding import ClassShard

    world, rank, device = dims.world_size, dims.rank, dims.device
    generator = torch.Generator().manual_seed(0)
    classes, batch, tau = 50_000, 128, 0.15
    chunk = max(256, classes // world // 5)  # about five chunks per rank, the last one shorter
    features = F.normalize(torch.randn(batch, 128, generator=generator), dim=1).to(device)
    weight = torch.randn(classes, 128, generator=generator).to(device)
    ids = torch.randint(0, classes, (batch,), generator=generator).to(device)
    shard = ClassShard(classes, world, rank)
    rows = slice(shard.class_start, shard.class_end)
    cols = torch.where(shard.is_local(ids), ids - shard.class_start, -1)[:, None]
    errors = {}
    # bf16: against the reference on the same (rounded) features; its logits are rounded once more
    for dtype, loss_limit, grad_limit in ((torch.float32, 1e-4, 1e-5), (torch.bfloat16, 1e-2, 5e-4)):
        inputs = features.to(dtype)
        local_weight = weight[rows].clone().requires_grad_()
        loss = sharded_cosine_ce(inputs, local_weight, cols, torch.ones(batch, 1, device=device),
                                 KernelSettings(temperature=tau, chunk_size=chunk), dims.classifier_group)
        loss.sum().backward()
        reference_weight = weight.clone().requires_grad_()
        reference = F.cross_entropy(inputs.float() @ F.normalize(reference_weight, dim=1).t() / tau, ids,
                                    reduction="none")
        reference.sum().backward()
        errors[dtype] = (float((loss.float() - reference).detach().abs().max()),
                         float((local_weight.grad - reference_weight.grad[rows]).abs().max()), loss_limit, grad_limit)
    ok = all(loss_error < loss_limit and grad_error < grad_limit
             for loss_error, grad_error, loss_limit, grad_limit in errors.values())
    (fp32_loss, fp32_grad, *_), (bf16_loss, bf16_grad, *_) = errors.values()
    return CheckResult(
        "sharded classifier",
        PASS if ok else FAIL,
        f"loss diff {fp32_loss:.1e} fp32, {bf16_loss:.1e} bf16",
        f"N={classes} over {world} ranks in chunks of {chunk}, dW diff {fp32_grad:.1e} fp32, {bf16_grad:.1e} bf16",
    )


# A measured peak above the plan by more than this is a planner defect: a job it says fits may not.
PLAN_UNDERESTIMATE_LIMIT = 1.15


JOB_STEP = "in1k job step"


def shipped_job_step(dims) -> CheckResult:
    """One training step of the shipped ImageNet-1K job (``shipped_job``: its DeepSpeed config, its
    ResNet-50 + head and its per-GPU batch of one view) and the sharded classifier; its peak allocated
    memory against what ``instcls plan`` predicts for the same step (the planner's allocator share: the
    CUDA context and NCCL buffers are outside ``max_memory_allocated``, and DALI is not used here)."""
    if dims.device.type != "cuda":
        return CheckResult(JOB_STEP, SKIPPED, "", "needs a CUDA device")
    from trainer.config_deepspeed import load_deepspeed_config
    from trainer.selftest.shipped_job import JOB_CONFIG, load_shipped_job

    job = load_shipped_job()
    batch, side = job.data.loader.batch_size, job.data.loader.augment.image_size
    ds_config = load_deepspeed_config(job.deepspeed_config, batch, job.optim.clip_grad_norm)
    from trainer.classifier import ClassifierConfig, ShardedCosineClassifier  # DeepSpeed's import: seconds
    from trainer.engine.deepspeed_setup import engine_dtype, initialize_backbone
    from trainer.models import build_model
    from trainer.models.backbone import model_input

    model_config, classifier_config = job.model, ClassifierConfig(num_classes=1_281_167, validate_inputs=False)
    engine, _ = initialize_backbone(build_model(model_config), ds_config, 0.1, 0.9, 1e-4)
    classifier = ShardedCosineClassifier(classifier_config, dims)
    images = model_input(torch.randn(batch, 3, side, side, device=dims.device), engine_dtype(engine), model_config)
    ids = torch.randint(0, 1_281_167, (batch,), device=dims.device)
    torch.cuda.reset_peak_memory_stats(dims.device)  # the batch counted as the loader's, not its fp32 draw
    started = time.perf_counter()
    loss = classifier(engine(images), ids)
    engine.backward(loss)
    engine.step()
    torch.cuda.synchronize(dims.device)
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated(dims.device)
    planned = _planned_allocations(model_config, classifier_config, ds_config, dims.world_size, batch)
    ratio = peak / planned
    status = PASS if torch.isfinite(loss) and ratio <= PLAN_UNDERESTIMATE_LIMIT else FAIL
    return CheckResult(
        JOB_STEP,
        status,
        f"{peak / 2**30:.1f} GiB peak = {ratio:.2f} x plan",
        f"{job.deepspeed_config.name} from {JOB_CONFIG}: {model_config.arch}, batch {batch}/rank, N=1.28M over "
        f"{dims.world_size} ranks, {seconds:.2f} s; plan {planned / 2**30:.1f} GiB (fails above "
        f"{PLAN_UNDERESTIMATE_LIMIT:.2f} x)",
    )


def _planned_allocations(model_config, classifier_config, ds_config: dict, ranks: int, batch: int) -> int:
    """``instcls plan``'s bytes for this step that the caching allocator serves (no context, no DALI)."""
    from trainer import planning

    plan = planning.PlanInput(
        mode="dhp",
        num_classes=classifier_config.num_classes,
        ranks=ranks,
        batch=batch * ranks,
        dim=model_config.feature_dim,
        chunk_size=classifier_config.chunk_size,
        backbone=model_config.arch,
        views=1,
        dali=False,
        **planning.deepspeed_settings(ds_config),
    )
    return sum(size for part, size in planning.predict(plan).items() if not part.startswith("buffers"))


shipped_job_step.row_name = JOB_STEP  # merged rows take check_name (its function name would be "shipped job step")
DISTRIBUTED_CHECKS = (collectives, sharded_classifier, shipped_job_step)
