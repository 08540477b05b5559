"""The trainer's teacher seam with a method written in this file: an objective that asks for a momentum
teacher trains through the real trainer, checkpoints its teacher and resumes bit-identically; the
teacher moves from the student's fp32 master weights under DeepSpeed's bf16 and ZeRO setups, never
from the bf16 module copy.

The toy method regresses the student's first view onto the teacher's second (BYOL's loss without its
predictor).  One process start runs what the fast tests check (each start costs seconds); ZeRO-1/2
on two ranks are in the slow tier.
"""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.training import FAST, REPO
from trainer.checkpoint import save_checkpoint
from trainer.checkpoint.teacher_state import TeacherState
from trainer.objectives import LossOut, Objective, ObjectiveConfig, TeacherRequest, register_objective
from trainer.parallel.launch import spawn_local_workers

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("momentum-teacher")]  # one worker runs the shared start

TOTAL_STEPS = 4


@dataclass(frozen=True)
class ToyTeacherConfig(ObjectiveConfig):
    """Attributes: name: "toy_teacher"; momentum: the teacher's base momentum (cosine schedule)."""

    name: str = "toy_teacher"
    momentum: float = 0.9

    def teacher_request(self, views):
        return TeacherRequest(views=(1,), momentum=self.momentum, schedule="cosine", field="objective.momentum")


class ToyTeacherObjective(Objective):
    skips_on_device = True  # no state of its own but a counter: the device decides a dropped step

    def __init__(self, config, context) -> None:
        super().__init__(config, context)
        self.steps_after = 0

    def loss(self, step) -> LossOut:
        (teacher,) = step.teacher
        assert teacher.index == 1 and not teacher.features.requires_grad
        student = F.normalize(step.views[0].features.float(), dim=1)
        per_sample = 2 - 2 * (student * F.normalize(teacher.features.float(), dim=1)).sum(1)
        share = self.context.dims.world_size / step.global_valid  # the global valid mean, once averaged
        return LossOut((per_sample * step.valid).sum() * share)

    def after_optimizer_step(self, taken) -> None:
        self.steps_after += 1

    def state_dict(self):
        return {"steps_after": self.steps_after}

    def load_state_dict(self, state) -> None:
        self.steps_after = state["steps_after"]


def _settings(run_dir: Path, shards: dict, overrides: list[str]) -> list[str]:
    return [f"data.train_shards={shards['train']}", f"checkpoint.dir={run_dir}/checkpoints",
            f"logging.dir={run_dir}/logs", "logging.progress=false", "logging.metrics_port=0",
            "eval.knn_at_end=false", "checkpoint.every_epochs=0", "objective={name: toy_teacher}", *FAST,
            "data.loader.batch_size=16", "model.arch=resnet10",
            "model.head_hidden_dim=32", "checkpoint.every_steps=2",
            "logging.log_every=1", f"max_steps={TOTAL_STEPS}", "optim.on_nonfinite=skip_step", *overrides]


def _train_and_resume(root: str, shards: dict) -> None:
    """An uninterrupted run of 4 steps (saving at 2 and 4), then a run resumed from its step-2 checkpoint
    alone, in one process."""
    from trainer.config import load_job_config
    from trainer.engine.trainer import Trainer
    from trainer.parallel import init_distributed

    register_objective("toy_teacher", ToyTeacherConfig, ToyTeacherObjective)
    dims = init_distributed()
    root = Path(root)
    config = load_job_config(REPO / "configs" / "digits_cpu.yaml", _settings(root / "uninterrupted", shards, []))
    trainer = Trainer(config, dims, resume="none")
    assert trainer.device_skip is not None  # the dropped-step decision on the device: the masked update
    trainer.train()
    shutil.copytree(root / "uninterrupted" / "checkpoints" / "step_000000002",
                    root / "interrupted" / "checkpoints" / "step_000000002")
    config = load_job_config(REPO / "configs" / "digits_cpu.yaml", _settings(root / "interrupted", shards, []))
    Trainer(config, dims, resume="auto").train()


class _TwoLayers(torch.nn.Module):
    """A small network taking a list of batches, as the trainer's does; uneven widths, so that ZeRO's
    partitions cut across its tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(48, 37), torch.nn.ReLU(), torch.nn.Linear(37, 11))

    def forward(self, batches):
        return [self.body(batch) for batch in batches]


def _followed_masters(out: str, ds_config: str) -> None:
    """Three steps of a small network; after each, the teacher against the hand-written fp32 update of
    its previous values from the student's fp32 masters as DeepSpeed hands them out."""
    from trainer.engine.deepspeed_setup import engine_dtype, initialize_backbone, load_deepspeed_config
    from trainer.engine.momentum_teacher import MomentumTeacher
    from trainer.parallel import init_distributed
    from trainer.parallel.deepspeed_import import safe_get_full_fp32_param

    dims = init_distributed()
    torch.manual_seed(0)
    model = _TwoLayers()
    network = copy.deepcopy(model)  # the teacher: fp32, before DeepSpeed casts the student
    engine, _ = initialize_backbone(model, load_deepspeed_config(REPO / "ds_configs" / f"{ds_config}.json", 4), 0.5)
    momentum = 0.999
    teacher = MomentumTeacher(TeacherRequest(views=(0,), momentum=momentum), network, engine, total_steps=3)

    def masters() -> dict[str, torch.Tensor]:
        """The fp32 master of every parameter: DeepSpeed's accessor (ZeRO-1/2, its bf16 optimizer), or at
        ZeRO-0 bf16 the fp32 copy DeepSpeed's FP16_UnfusedOptimizer pairs with each bf16 parameter."""
        names = {id(p): name for name, p in engine.module.named_parameters()}
        optimizer = engine.optimizer
        if hasattr(optimizer, "fp32_groups") and hasattr(optimizer, "fp16_groups"):
            return {names[id(p)]: master.detach() for group, masters in zip(optimizer.fp16_groups,
                                                                            optimizer.fp32_groups)
                    for p, master in zip(group, masters)}
        return {name: safe_get_full_fp32_param(p) for name, p in engine.module.named_parameters()}

    report = {"steps": [], "dtype": str(engine_dtype(engine))}
    for step in range(3):
        torch.manual_seed(100 + step * dims.world_size + dims.rank)
        before = {name: p.detach().clone() for name, p in teacher.network.named_parameters()}
        loss = engine([torch.randn(4, 48).to(engine_dtype(engine))])[0].float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        teacher.update(step, True)
        full = masters()
        moved = dict(teacher.network.named_parameters())
        module = dict(engine.module.named_parameters())
        report["steps"].append({
            "equal": all(torch.equal(moved[n], before[n] * momentum + full[n].float() * (1 - momentum)) for n in full),
            "moved": sum(int((moved[n] != before[n]).sum()) for n in full),
            "elements": sum(full[n].numel() for n in full),
            # the same update from the bf16 module copy is another teacher: the masters are what is read
            "as_from_bf16": all(torch.equal(moved[n], before[n] * momentum
                                            + module[n].detach().float() * (1 - momentum)) for n in full),
        })
    Path(out, f"rank-{dims.rank}.json").write_text(json.dumps(report))
    save_checkpoint(Path(out, "checkpoints"), 3, {"teacher": TeacherState(teacher, statistics_differ=False)}, dims,
                    keep=1)


def _reloaded(out: str, ds_config: str) -> None:
    """The teacher of ``_followed_masters``'s checkpoint loaded on another number of ranks (its own ZeRO
    partitions), then moved once more from this run's masters."""
    from trainer.checkpoint.components import load_checkpoint
    from trainer.engine.deepspeed_setup import engine_dtype, initialize_backbone, load_deepspeed_config
    from trainer.engine.momentum_teacher import MomentumTeacher
    from trainer.parallel import init_distributed
    from trainer.parallel.deepspeed_import import safe_get_full_fp32_param

    dims = init_distributed()
    torch.manual_seed(1)  # another start than the saved run's: everything must come from the checkpoint
    model = _TwoLayers()
    network = copy.deepcopy(model)
    engine, _ = initialize_backbone(model, load_deepspeed_config(REPO / "ds_configs" / f"{ds_config}.json", 4), 0.5)
    teacher = MomentumTeacher(TeacherRequest(views=(0,), momentum=0.9), network, engine, total_steps=3)
    checkpoint = sorted(Path(out, "checkpoints").glob("step_*[0-9]"))[-1]
    load_checkpoint(checkpoint, {"teacher": TeacherState(teacher, statistics_differ=False)}, dims)
    saved = torch.load(checkpoint / "teacher" / "model.pt", weights_only=True)
    loaded = all(torch.equal(value, saved[name]) for name, value in teacher.network.state_dict().items())
    before = {name: p.detach().clone() for name, p in teacher.network.named_parameters()}
    engine.backward(engine([torch.randn(4, 48).to(engine_dtype(engine))])[0].float().pow(2).mean())
    engine.step()
    teacher.update(0, True)
    full = {name: safe_get_full_fp32_param(p) for name, p in engine.module.named_parameters()}
    moved = dict(teacher.network.named_parameters())
    equal = all(torch.equal(moved[n], before[n] * 0.9 + full[n].float() * (1 - 0.9)) for n in full)
    Path(out, f"reloaded-{dims.rank}.json").write_text(json.dumps({"loaded": loaded, "equal": equal}))


@pytest.fixture(scope="module")
def runs(tiny_digits_split, tmp_path_factory):
    """One process: the bf16 ZeRO-0 master check, then the training runs (one start instead of two)."""
    root = tmp_path_factory.mktemp("teacher")
    spawn_local_workers(_fast_checks, 1, str(root), tiny_digits_split)
    yield root
    shutil.rmtree(root, ignore_errors=True)  # three checkpoints of a ResNet-10 with its teacher: ~400 MB


def _fast_checks(root: str, shards: dict) -> None:
    torch.set_num_threads(1)  # a network this small gains nothing from a second thread but its spinning CPU time
    _followed_masters(root, "zero0_bf16")
    _train_and_resume(root, shards)


def _checkpoint(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:09d}"


@pytest.mark.slow  # the suite's budget: tests/unit/test_momentum_teacher.py holds the ZeRO-0 EMA and the skip
def test_the_teacher_follows_the_fp32_masters_of_a_bf16_engine_at_zero0(runs):
    report = json.loads((runs / "rank-0.json").read_text())
    assert report["dtype"] == "torch.bfloat16"
    for step in report["steps"]:
        assert step["equal"] and not step["as_from_bf16"]
        assert step["moved"] > 0.5 * step["elements"]  # at momentum 0.999: a bf16 teacher would not move


@pytest.mark.slow  # the suite's budget: tests/unit/test_momentum_teacher.py holds the ZeRO-0 EMA and the skip
def test_a_resumed_run_continues_teacher_and_student_bit_for_bit(runs):
    """Uninterrupted, and resumed at step 2: the same teacher, student and hook count at step 4; the
    teacher moved from its start and is not the student."""
    resumed = _checkpoint(runs / "interrupted", TOTAL_STEPS)
    reference = _checkpoint(runs / "uninterrupted", TOTAL_STEPS)
    for name in ("teacher/model.pt", "model.pt"):
        a, b = (torch.load(c / name, weights_only=True) for c in (resumed, reference))
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), name
    teacher = torch.load(reference / "teacher/model.pt", weights_only=True)
    student = torch.load(reference / "model.pt", weights_only=True)
    start = torch.load(_checkpoint(runs / "uninterrupted", 2) / "teacher/model.pt", weights_only=True)
    weights = [k for k in teacher if k.endswith("weight") and teacher[k].dtype == torch.float32]
    assert any(not torch.equal(teacher[k], start[k]) for k in weights), "the teacher never moved"
    assert any(not torch.equal(teacher[k], student[k]) for k in weights), "the teacher is the student"
    for run in (resumed, reference):
        hook = torch.load(run / "components" / "objective" / "rank-00000.pt", weights_only=True)
        assert hook["steps_after"] == TOTAL_STEPS
    log = [json.loads(line) for line in (runs / "interrupted" / "logs" / "rank-00000.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in log if entry["event"] == "step"] == [3, 4]  # it resumed at 2


@pytest.mark.slow
@pytest.mark.parametrize("ds_config", ["zero1_bf16", "zero2", "zero2_bf16"])
def test_the_teacher_follows_the_fp32_master_partitions_under_zero_and_reloads_on_other_ranks(ds_config, tmp_path):
    """Two ranks: each moves its partition of the teacher from its own fp32 master partition, and the
    gathered teacher is the hand-written update of the whole, on both ranks.  Its checkpoint loads on
    one rank (other partitions), where the next update is again the hand-written one."""
    spawn_local_workers(_followed_masters, 2, str(tmp_path), ds_config)
    for rank in range(2):
        report = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        for step in report["steps"]:
            assert step["equal"] and step["moved"] > 0.5 * step["elements"]
            if report["dtype"] == "torch.bfloat16":
                assert not step["as_from_bf16"]
    spawn_local_workers(_reloaded, 1, str(tmp_path), ds_config)
    assert json.loads((tmp_path / "reloaded-0.json").read_text()) == {"loaded": True, "equal": True}
