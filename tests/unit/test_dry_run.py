"""`instcls dry-run`: the job's step on fake CUDA devices, with no GPU.

Each objective (and CO2) runs at small N as 4 ranks with nothing found; planted faults (a host
sync, a device mismatch, one rank's extra collective) are each reported with their line; and the
private PyTorch pieces it stands on (the ``fake`` process group, ``MemTracker`` under fake tensors,
the nodes of an autograd graph being callable) are pinned here."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainer.config import load_job_config
from trainer.dry_run.backward import backward
from trainer.dry_run.job import dry_run_job, format_result
from trainer.dry_run.rank_step import restart_peak
from trainer.objectives import OBJECTIVES, LossOut, Objective, ObjectiveConfig, register_objective

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
THIS_FILE = "tests/unit/test_dry_run.py"


def _config(name: str, *overrides: str):
    return load_job_config(CONFIGS / name, list(overrides))


@pytest.mark.parametrize("name, overrides, n, epoch, steps, like_plan", [
    ("in1k_r50_64gpu.yaml", [], 8192, 0, 2, True),  # instance with top-K smoothing, bf16
    # the CO2 term in the kernel, over 2 chunks per rank (its fused functions run twice per pass)
    ("in1k_r50_64gpu.yaml", ["objective.co2_alpha=0.3", "objective.chunk_size=1024"], 8192, 0, 2, True),
    # PIC: the queue (4096) is full after 2 steps of 2048, so later steps write rows back to the host store
    ("pic_in1k_r50.yaml", ["objective.queue_size=4096", "data.loader.batch_size=512",
                           "data.loader.sampler.window_size=0", "data.loader.sampler.stride=0"], 65536, 0, 4, True),
    # the queue is on from epoch 15; 512 features fill it in 2 steps of 4 x 64, so the third step's
    # Sinkhorn runs over the batch and the full queue, as the planner counts it
    ("swav_in1k_r50.yaml", ["objective.queue_length=512"], 8192, 15, 3, True),
    # MoCo v2 with CO2: the queue's share scored by the sharded kernel, keys from the teacher, enqueued after
    # each step; 3 steps of 4 x 64 keys wrap a queue of 512
    ("moco_v2_in1k_r50.yaml", ["objective.co2_alpha=0.3", "objective.queue_size=512", "data.loader.batch_size=64"],
     8192, 0, 3, True),
    # PIC with CO2: the sampled rows per rank change every step; the chunk shapes are
    # bucketed, so the fused term compiles in few steps, not in each (its queue is far from full: no
    # memory comparison with the planner, which counts a full one)
    pytest.param("pic_in1k_r50.yaml", ["objective.co2_alpha=0.3", "data.loader.sampler.window_size=0",
                                       "data.loader.sampler.stride=0"], 1281167, 0, 8, False, marks=pytest.mark.slow),
])
@pytest.mark.integration
def test_each_objective_runs_on_fake_cuda_with_nothing_found(name, overrides, n, epoch, steps, like_plan):
    config = _config(name, *overrides)
    result = dry_run_job(config, n, world_size=4, rank=1, steps=steps, epoch=epoch)
    text = format_result(result, config, name)
    assert result.clean, text
    assert sorted(result.reports) == [0, 1, 3]
    report = result.report
    assert report.peak_bytes > 0 and report.collectives
    if like_plan and result.planned_objective is not None:  # the planner's model of the same step agrees within 50%
        assert 0.5 < report.peak_bytes / result.planned_objective < 1.5, text
    if name.startswith("pic") and "objective.co2_alpha=0.3" in overrides:  # chunks of 2^k rows (k >= 6)
        logits_rows = [int(next(s for s in c.shapes.split(", ") if s.count("x") == 1).split("x")[0])
                       for step in report.compilations for c in step]
        assert logits_rows and all(rows >= 64 and rows & (rows - 1) == 0 for rows in logits_rows), text
    if name.startswith("pic") and "objective.queue_size=4096" in overrides:
        # rows were written back, from pinned staging memory, waited for off the training thread
        settled = [s for s in report.step_syncs if "settle" in s.where]
        assert settled and all(s.background for s in settled), text



@dataclasses.dataclass(frozen=True)
class PlantedConfig(ObjectiveConfig):
    name: str = "planted"
    fault: str = "none"


class Planted(Objective):
    """A replicated linear classifier with one planted fault."""

    def __init__(self, config, context):
        super().__init__(config, context)
        self.fc = torch.nn.Linear(context.feature_dim, 16).to(context.dims.device)
        self.sgd = torch.optim.SGD(self.fc.parameters(), lr=0.0)

    def optimizers(self):
        return [self.sgd]

    def loss(self, step):
        features = self.stacked_features(step).float()
        if self.config.fault == "host sync":
            features = features * features.sum().item()
        if self.config.fault == "device mismatch":
            features = features + torch.ones(1, features.shape[1])  # a host tensor, not a 0-d one
        logits = self.fc(features)
        return LossOut(F.cross_entropy(logits, torch.zeros(len(logits), dtype=torch.long, device=logits.device)))

    def after_backward(self):
        if self.config.fault == "divergence" and self.context.dims.rank == 2:
            dist.all_reduce(self.fc.weight.grad)  # only rank 2: the others never join it


@pytest.fixture
def planted():
    register_objective("planted", PlantedConfig, Planted)
    yield lambda fault: dataclasses.replace(_config("in1k_r50_64gpu.yaml"), objective=PlantedConfig(fault=fault))
    OBJECTIVES.pop("planted")


def _line_of(pattern: str) -> int:
    return next(i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1) if pattern in line)


def test_a_planted_host_sync_is_reported_with_its_line(planted):
    config = planted("host sync")
    clean = dry_run_job(planted("none"), 1024, world_size=4, compare=[0, 1], steps=2)
    assert clean.clean, format_result(clean, config, "planted")
    result = dry_run_job(config, 1024, world_size=4, compare=[0, 1], steps=2)
    text = format_result(result, config, "planted")
    assert not result.clean and len(result.step_syncs()) == 1, text
    [(sync, steps)] = result.step_syncs().items()
    assert (sync.kind, sync.op, steps) == ("device to host", "aten._local_scalar_dense.default", 2)
    assert sync.where.startswith(f"{THIS_FILE}:{_line_of('features.sum().item()')} in loss")


def test_a_planted_device_mismatch_stops_the_step_and_names_its_line(planted):
    result = dry_run_job(planted("device mismatch"), 1024, world_size=4, compare=[0, 1], steps=2)
    assert set(result.stopped) == {0, 1}
    assert re.search(r"cuda:0.*cpu|cpu.*cuda:0", result.stopped[0]), result.stopped[0]
    assert result.stopped[1].endswith(f"at {THIS_FILE}:{_line_of('torch.ones(1, features.shape[1])')} in loss")


def test_one_ranks_extra_collective_is_reported_as_a_disagreement(planted):
    result = dry_run_job(planted("divergence"), 1024, world_size=4, compare=[0, 2, 3], steps=1)
    disagreement = result.disagreement
    assert disagreement is not None and disagreement.group == (0, 1, 2, 3)
    assert disagreement.by_rank[0] is None and disagreement.by_rank[3] is None
    assert disagreement.by_rank[2].op == "allreduce_"
    assert disagreement.by_rank[2].where.startswith(f"{THIS_FILE}:{_line_of('dist.all_reduce(self.fc.weight.grad)')}")
    # The report shows each rank's side of it (the one test of format_result's text).
    assert str(disagreement) in format_result(result, planted("divergence"), "planted")


# -- the private PyTorch pieces the dry run relies on ---------------------------------------------


def test_the_fake_process_group_dispatches_collectives_that_a_mode_can_see():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from trainer.dry_run.collectives import CollectiveRecorder

    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=64)
    try:
        group = dist.new_group(list(range(8)))
        with FakeTensorMode(), CollectiveRecorder() as recorder:
            x = torch.empty(4, 3, device="cuda", dtype=torch.bfloat16)
            dist.all_reduce(x, group=group)
            dist.all_gather_into_tensor(torch.empty(256, 3, device="cuda"), torch.empty(4, 3, device="cuda"))
    finally:
        dist.destroy_process_group()
    assert [(c.op, c.group, c.tensors) for c in recorder.collectives] == [
        ("allreduce_", tuple(range(8)), ("bfloat16[4, 3]",)),
        ("_allgather_base_", tuple(range(64)), ("float32[256, 3]", "float32[4, 3]")),
    ]


def test_memtracker_measures_the_peak_of_fake_cuda_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    with FakeTensorMode(), MemTracker() as tracker:
        kept = torch.empty(1 << 20, device="cuda")  # 4 MiB
        temporary = torch.empty(3 << 20, device="cuda")  # 12 MiB, freed below
        del temporary
        torch.empty(1 << 20, device="cuda")  # 4 MiB, freed at once
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cuda", 0)]["Total"]
        restart_peak(tracker)  # the dry run's step peak starts after the set-up
        torch.empty(2 << 20, device="cuda")  # 8 MiB, freed at once
        step_peak = tracker.get_tracker_snapshot("peak")[torch.device("cuda", 0)]["Total"]
    assert peak == 16 << 20 and step_peak == 12 << 20 and kept.numel() == 1 << 20


def test_the_node_by_node_backward_gives_autograds_gradients():
    class Square(torch.autograd.Function):  # a custom Function with two outputs, one unused
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x, x + 1

        @staticmethod
        def backward(ctx, grad_square, grad_shift):
            (x,) = ctx.saved_tensors
            return 2 * x * grad_square + grad_shift

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, 4, dtype=torch.float64, generator=generator, requires_grad=True)
    w = torch.randn(4, 5, dtype=torch.float64, generator=generator, requires_grad=True)

    bias = torch.randn(5, dtype=torch.float64, generator=generator, requires_grad=True)

    def loss():  # a broadcast bias, a split, a custom Function with an unused output, a repeated input
        squared, _ = Square.apply(F.normalize(x))
        head, tail = torch.addmm(bias, squared, w).split([2, 4])
        return F.cross_entropy(torch.cat([head, tail * 2]), torch.arange(6) % 5) + (x * x).sum()

    loss().backward()
    expected = [t.grad.clone() for t in (x, w, bias)]
    x.grad = w.grad = bias.grad = None
    backward(loss())
    assert all(torch.equal(t.grad, e) for t, e in zip((x, w, bias), expected))


def test_the_simulated_step_builds_the_objective_with_the_jobs_backbone_optimizer(monkeypatch):
    """As the trainer does: SwAV's prototypes are stepped by the job's optimizer (LARS here), not SGD."""
    from trainer.dry_run import rank_step
    from trainer.parallel import single_process_dims

    built = []

    def recording(config, context):
        built.append(context)
        raise RuntimeError("recorded")

    monkeypatch.setattr(rank_step, "build_objective", recording)
    config = _config("swav_in1k_r50.yaml")
    with pytest.raises(RuntimeError, match="recorded"):
        rank_step.run_objective_steps(config, single_process_dims(torch.device("cpu")), 1024, 1, 0,
                                      rank_step.RankReport(0, 1, 1), probe=None)
    assert built[0].optim.backbone_optimizer == config.optim.optimizer_settings()
    assert built[0].optim.backbone_optimizer.name == "lars"
