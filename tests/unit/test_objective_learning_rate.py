"""``optim.objective_base_lr``: the objective's own optimizers (the classifier rows' SGD) follow the
backbone's warm-up and cosine at their own peak, through the trainer's own lr-setting code
(``StepSchedules``, what ``Trainer._step`` calls before each step).  Unset, they see the backbone's
learning rate exactly, as before the field existed; SwAV's prototypes, stepped with the backbone's
optimizer, always do."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from trainer.checkpoint.run_fingerprint import run_fingerprint
from trainer.config import ConfigError, load_job_config
from trainer.engine.schedule import LRSchedule, StepSchedules, refuse_unused_objective_settings, scaled_lr
from trainer.objectives import InstanceConfig, ObjectiveContext, OptimSettings, PicConfig, SwavConfig, build_objective
from trainer.optim import OptimizerSettings, build_optimizer
from trainer.parallel import single_process_dims

ADAMW = OptimizerSettings(name="adamw", momentum=0.9, weight_decay=0.05)
STEPS_PER_EPOCH, GLOBAL_BATCH = 3, 512
OPTIM = ("{name: adamw, base_lr: 0.001, base_batch: 256, epochs: 10, warmup_epochs: 2, min_lr_ratio: 0.01, "
         "weight_decay: 0.05")


def _job(tmp_path, optim: str, objective: str = "{name: instance}"):
    path = tmp_path / "job.yaml"
    path.write_text(f"data: {{train_shards: x}}\noptim: {optim}\nobjective: {objective}")
    return load_job_config(path)


def _objective(config):
    context = ObjectiveContext(dims=single_process_dims(torch.device("cpu")), num_instances=16, feature_dim=4, seed=0,
                               optim=OptimSettings(momentum=0.9, weight_decay=1e-4, backbone_optimizer=ADAMW))
    return build_objective(config, context)


def _learning_rates(job, objective) -> list[tuple[float, list[float]]]:
    """(backbone's lr, [each objective optimizer's lr]) read from the param groups after the
    trainer's lr-setting code ran for each step of the job, and a few steps past its end."""
    schedules = StepSchedules.of_job(job.optim, GLOBAL_BATCH, STEPS_PER_EPOCH)
    backbone = build_optimizer(ADAMW, nn.Linear(2, 2), lr=0.0)
    seen = []
    for step in range(job.optim.epochs * STEPS_PER_EPOCH + 3):
        returned = schedules.apply(step, backbone, objective)
        assert {group["lr"] for group in backbone.param_groups} == {returned}
        seen.append((returned, [group["lr"] for o in objective.optimizers() for group in o.param_groups]))
    return seen


def _warmup_cosine(base_lr: float, step: int) -> float:
    """The job's schedule written out: base_lr * 512 / 256, 6 warm-up steps, cosine to 1% by step 30."""
    peak, warmup, total = base_lr * GLOBAL_BATCH / 256, 2 * STEPS_PER_EPOCH, 10 * STEPS_PER_EPOCH
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / (total - warmup))
    return peak * 0.01 + peak * 0.99 * 0.5 * (1 + math.cos(math.pi * progress))


def test_unset_the_objective_optimizers_see_the_backbone_learning_rate_as_before(tmp_path):
    job = _job(tmp_path, OPTIM + "}")
    assert job.optim.objective_base_lr is None
    schedules = StepSchedules.of_job(job.optim, GLOBAL_BATCH, STEPS_PER_EPOCH)
    assert schedules.objective is schedules.backbone
    # the schedule the trainer built before the field existed, bit for bit
    peak = scaled_lr(job.optim.base_lr, job.optim.base_batch, GLOBAL_BATCH)
    assert schedules.backbone == LRSchedule(peak_lr=peak, warmup_steps=round(2 * STEPS_PER_EPOCH),
                                            total_steps=10 * STEPS_PER_EPOCH, min_lr=peak * 0.01)
    for objective_config in (InstanceConfig(top_k=2), PicConfig(queue_size=4, prefetch=False)):
        for backbone_lr, objective_lrs in _learning_rates(job, _objective(objective_config)):
            assert objective_lrs and all(lr == backbone_lr for lr in objective_lrs)


@pytest.mark.parametrize("objective_config", [InstanceConfig(top_k=2), PicConfig(queue_size=4, prefetch=False)],
                         ids=["instance", "pic"])
def test_set_the_classifier_rows_follow_the_same_warmup_and_cosine_at_their_own_peak(tmp_path, objective_config):
    job = _job(tmp_path, OPTIM + ", objective_base_lr: 0.5}")
    seen = _learning_rates(job, _objective(objective_config))
    for step, (backbone_lr, objective_lrs) in enumerate(seen):
        assert backbone_lr == pytest.approx(_warmup_cosine(0.001, step), rel=1e-12)
        for lr in objective_lrs:
            assert lr == pytest.approx(_warmup_cosine(0.5, step), rel=1e-12), step
            assert lr / backbone_lr == pytest.approx(500, rel=1e-12), step
    assert seen[0][1][0] == pytest.approx(0.5 * 2 / 6) and seen[6][1][0] == pytest.approx(1.0)  # warm-up, then peak
    assert seen[-1][1][0] == pytest.approx(0.01)  # the floor, min_lr_ratio of the objective's peak


def test_swav_prototypes_stepped_by_the_backbones_optimizer_keep_the_backbones_learning_rate(tmp_path):
    """SwAV's code steps its prototypes with the model's optimizer: they take its learning rate, so
    ``objective_base_lr`` would change nothing for SwAV and is refused; instance and PIC take it."""
    job = _job(tmp_path, OPTIM + "}")
    swav = _objective(SwavConfig(num_prototypes=8))
    assert swav.backbone_lr_optimizers() == swav.optimizers()
    setting = _job(tmp_path, OPTIM + ", objective_base_lr: 0.5}")
    for backbone_lr, objective_lrs in _learning_rates(setting, swav):
        assert objective_lrs == [backbone_lr] * len(objective_lrs)
    with pytest.raises(ValueError, match=r"optim.objective_base_lr=0.5 is set, but objective.name='swav' steps all "
                                         r"its parameters with the backbone's optimizer"):
        refuse_unused_objective_settings(setting.optim, swav, "swav")
    decay = _job(tmp_path, OPTIM + ", objective_weight_decay: 0.0001}")
    with pytest.raises(ValueError, match=r"optim.objective_weight_decay=0.0001 is set, but objective.name='swav'"):
        refuse_unused_objective_settings(decay.optim, swav, "swav")
    refuse_unused_objective_settings(job.optim, swav, "swav")  # unset: nothing to refuse
    for optim in (setting.optim, decay.optim):
        refuse_unused_objective_settings(optim, _objective(InstanceConfig(top_k=2)), "instance")


def test_the_classifier_rows_take_their_own_weight_decay_and_the_backbone_keeps_its_own(tmp_path):
    """AdamW's ViT recipes decay the backbone by 0.05; the rows' SGD keeps the paper's 1e-4 when
    ``optim.objective_weight_decay`` says so, and ``weight_decay`` when it is unset."""
    for extra, rows_decay in (("", 0.05), (", objective_weight_decay: 0.0001", 1e-4)):
        optim = _job(tmp_path, OPTIM + extra + "}").optim
        settings = optim.objective_settings()
        assert settings.weight_decay == rows_decay and settings.backbone_optimizer.weight_decay == 0.05
        context = ObjectiveContext(dims=single_process_dims(torch.device("cpu")), num_instances=16, feature_dim=4,
                                   seed=0, optim=settings)
        rows_sgd, = build_objective(InstanceConfig(top_k=2), context).optimizers()
        assert {group["weight_decay"] for group in rows_sgd.param_groups} == {rows_decay}
    with pytest.raises(ConfigError, match=r"optim.objective_weight_decay=-1.0 is invalid"):
        _job(tmp_path, "{objective_weight_decay: -1}")


@pytest.mark.parametrize("value", ["0", "-0.5"])
def test_a_learning_rate_that_is_not_positive_is_named_with_its_fix(tmp_path, value):
    with pytest.raises(ConfigError, match=rf"optim.objective_base_lr={float(value)} is invalid: use a positive "
                                          r"learning rate for the objective's own optimizers"):
        _job(tmp_path, f"{{objective_base_lr: {value}}}")


def test_the_objective_learning_rate_is_no_part_of_the_checkpoint_fingerprint(tmp_path):
    """A schedule setting: nothing saved depends on it, so a run resumes under another value."""
    unset, set_ = _job(tmp_path, OPTIM + "}"), _job(tmp_path, OPTIM + ", objective_base_lr: 0.5}")
    assert run_fingerprint(unset, 16) == run_fingerprint(set_, 16)


def test_skip_step_refuses_the_update_inside_the_backward_before_any_training():
    """That update happens before a non-finite step could be dropped: refused when the objective is
    built, before DeepSpeed starts, naming both settings and the fixes."""
    config = InstanceConfig(update_in_backward=True, top_k=5)
    context = ObjectiveContext(dims=single_process_dims(torch.device("cpu")), num_instances=16, feature_dim=4, seed=0,
                               optim=OptimSettings(momentum=0.9, weight_decay=1e-4, skips_nonfinite_steps=True))
    with pytest.raises(ValueError, match="objective.update_in_backward=true is invalid with optim.on_nonfinite: "
                                         "skip_step.*set update_in_backward: false .* or on_nonfinite: stop"):
        build_objective(config, context)
    build_objective(InstanceConfig(update_in_backward=False, top_k=5), context)  # the other choice builds
