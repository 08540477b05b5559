"""Each objective plans its own memory (``ObjectiveConfig.memory_plan``): SwAV as its prototypes and
queue, never as N classifier rows; an objective without a plan is refused by name; every shipped
config is planned as the objective it trains."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from trainer.bench import runtime_baseline
from trainer.config import load_job_config
from trainer.models import ModelConfig
from trainer.models.profile import model_profile
from trainer.objectives import OBJECTIVES, NoMemoryPlan, ObjectiveConfig, Prototypes, register_objective
from trainer.planning import objective_breakdown, predict
from trainer.planning.plan_from_config import plan_input_from_config

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def _plan_json(tmp_path, *args: str) -> dict:
    from trainer.cli import main

    path = tmp_path / "plan.json"
    assert main(["plan", *args, "--json", str(path)]) == 0
    return json.loads(path.read_text())


def test_swav_is_planned_as_its_prototypes_queue_and_sinkhorn_scores_not_as_n_rows():
    config = load_job_config(REPO / "configs/swav_in1k_r50.yaml", [])
    plan = plan_input_from_config(config, 8, 1_281_167)
    assert (plan.mode, plan.objective, plan.optimizer) == ("swav", Prototypes(3000, 3840, 2, "float32"), "lars")
    # By hand from the config: 64 images per rank, 2 x 224 + 6 x 96 crops, K 3000, D 128, a queue of
    # 3840 over 8 ranks (480 samples each, both global crops), LARS's momentum, fp32 Sinkhorn over
    # the batch and the queue: its queue scores, their concatenation and 3 working copies, which
    # outlast the swapped prediction's 14 saved log-softmax and 8 score gradients.
    b, views, crops, k, d, queued = 64, 8, 2, 3000, 128, 480
    swapped = (2 * 7 + 8) * b * k * 4
    assert objective_breakdown(plan) == {
        "prototypes (K x D, on every rank)": k * d * 4,
        "prototype gradients": k * d * 4,
        "prototype optimizer state (lars)": k * d * 4,
        "queue (its share x global crops x D)": queued * crops * d * 4,
        "features, scores and codes (b x K per view)": views * b * (d + k) * 4 + crops * b * k * 4,
        "swapped prediction (saved log-softmax, gradients)": swapped,
        "Sinkhorn beyond that ((b + queue share) x K)": queued * k * 4 + (b + queued) * k * (4 + 3 * 4) - swapped,
    }
    # The backbone sees each crop at its own side: 2 of 224 px and 6 of 96 px per sample, bf16.
    profile = {side: model_profile(ModelConfig(arch="resnet50"), side).activation_bytes for side in (224, 96)}
    assert predict(plan)["backbone activations"] == (2 * profile[224] + 6 * profile[96]) // 2 * b
    # Nothing of it is N rows: the whole prediction is the same at 1,000 and a billion instances.
    assert not [name for name in predict(plan) if "classifier" in name]
    assert predict(dataclasses.replace(plan, num_classes=10**9)) == predict(dataclasses.replace(plan, num_classes=1000))


def test_plan_of_the_swav_config_prints_prototypes_and_queue_without_asking_for_n(tmp_path, capsys):
    modes = _plan_json(tmp_path, "--config", str(REPO / "configs/swav_in1k_r50.yaml"), "--ranks", "64")
    assert list(modes) == ["swav"]
    breakdown = modes["swav"]["breakdown"]
    assert breakdown["prototypes (K x D, on every rank)"] == 3000 * 128 * 4
    assert breakdown["queue (its share x global crops x D)"] == 60 * 2 * 128 * 4
    out = capsys.readouterr().out
    assert out.startswith("SwAV (K=3,000 prototypes, queue 3,840): T=64") and "classifier weights" not in out


@dataclasses.dataclass(frozen=True)
class PlanlessConfig(ObjectiveConfig):
    name: str = "planless"


@pytest.fixture
def planless():
    register_objective("planless", PlanlessConfig, object)
    yield PlanlessConfig()
    OBJECTIVES.pop("planless")


def test_an_objective_without_a_memory_plan_is_refused_by_name_not_planned_as_another(planless, tmp_path):
    config = dataclasses.replace(load_job_config(REPO / "configs/digits_cpu.yaml", []), objective=planless)
    message = r"objective 'planless' has no memory plan: implement ObjectiveConfig.memory_plan in PlanlessConfig"
    with pytest.raises(NoMemoryPlan, match=message):
        plan_input_from_config(config, 2, 1000)
    from trainer.cli import main

    job = yaml.safe_load((REPO / "configs/digits_cpu.yaml").read_text())
    job["objective"] = {"name": "planless"}
    path = tmp_path / "planless.yaml"
    path.write_text(yaml.safe_dump(job))
    with pytest.raises(SystemExit, match=message):
        main(["plan", "--config", str(path), "--ranks", "2", "--num-classes", "1000"])


@pytest.mark.parametrize("path", CONFIGS, ids=[path.name for path in CONFIGS])
def test_every_shipped_config_is_planned_as_the_objective_it_trains(path, tmp_path, monkeypatch):
    monkeypatch.setattr(runtime_baseline, "runtime_rss_bytes", lambda dali: 2**30)  # CPU configs: not measured here
    config = load_job_config(path, [])
    ranks, n = 8, 100_000
    shards = Path(config.data.train_shards)
    args = [] if (shards if shards.is_absolute() else REPO / shards).joinpath("manifest.json").is_file() \
        else ["--num-classes", str(n)]
    modes = _plan_json(tmp_path, "--config", str(path), "--ranks", str(ranks), *args)
    objective = config.objective
    kind = {"instance": getattr(objective, "mode", None), "pic": "pic", "swav": "swav", "moco": "moco"}[objective.name]
    assert list(modes) == [kind]
    breakdown = modes[kind]["breakdown"]
    if objective.name == "swav":
        assert breakdown["prototypes (K x D, on every rank)"] == objective.num_prototypes * config.model.feature_dim * 4
        assert not [name for name in breakdown if "classifier" in name]
    elif objective.name == "pic":
        assert "sampled rows (W, momentum, gradient)" in breakdown
    elif objective.name == "moco":  # the queue's share, whatever N; no classifier rows
        share = -(-objective.queue_size // ranks)
        assert breakdown["queue keys (its share x D, fp32)"] == share * config.model.feature_dim * 4
        assert not [name for name in breakdown if "classifier" in name]
    elif args:  # instance, N known: the rows a rank holds
        rows = -(-n // ranks) if kind == "dhp" else n
        assert breakdown["classifier weights"] == rows * config.model.feature_dim * 4
    assert modes[kind]["recommended_zero_stage"] in (0, 1, 2, 3, None)
