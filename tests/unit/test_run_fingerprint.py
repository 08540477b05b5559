"""A checkpoint records what its tensors depend on; a resume under another job is one sentence."""

import json

import pytest

from tests.helpers.training import REPO
from trainer.checkpoint.run_fingerprint import fingerprint_mismatch, refuse_another_jobs_checkpoint, run_fingerprint
from trainer.config import load_job_config


def _fingerprint(*overrides, config="digits_cpu.yaml", instances=1438):
    return run_fingerprint(load_job_config(REPO / "configs" / config, list(overrides)), instances)


def test_the_fingerprint_holds_the_network_n_and_the_objectives_shapes():
    swav = _fingerprint(config="swav_demo_cpu.yaml")
    assert swav["model.arch"] == "resnet10" and swav["objective.name"] == "swav"
    assert {"objective.num_prototypes", "objective.queue_length", "data.train_shards (samples)"} <= set(swav)
    # What may change on resume is not in it: the learning rate, the epochs, the world size.
    assert _fingerprint("optim.base_lr=0.1", "optim.epochs=99") == _fingerprint()


@pytest.mark.parametrize("config, expected", [
    ("digits_cpu.yaml", "model.head is 'mlp' there and 'linear' here"),
    ("pic_demo_cpu.yaml", "objective.name is 'instance' there and 'pic' here"),
])
def test_each_difference_is_named(config, expected):
    current = _fingerprint("model.head=linear", "model.arch=resnet18", config=config)
    problem = fingerprint_mismatch(_fingerprint(), current, "ckpt/step_1")
    assert problem.startswith("checkpoint ckpt/step_1 was trained with another job: ") and expected in problem
    assert fingerprint_mismatch(_fingerprint(), _fingerprint(), "x") is None
    assert "samples) is 1438 there and 1000 here" in fingerprint_mismatch(
        _fingerprint(), _fingerprint(instances=1000), "x"
    )


def test_the_vits_pooling_and_the_input_standardisation_are_part_of_the_network():
    """The input standardisation adds no tensor and the pooling only renames the final LayerNorm, yet
    the weights compute other features under another value: a resume or an evaluation under
    another value is refused, naming it."""
    vit = _fingerprint(config="vit_tiny_cpu.yaml")
    assert (vit["model.pool"], vit["model.input_norm"]) == ("avg", "per_image")
    problem = fingerprint_mismatch(vit, _fingerprint("model.pool=token", "model.input_norm=none",
                                                     config="vit_tiny_cpu.yaml"), "x")
    assert "model.pool is 'avg' there and 'token' here" in problem
    assert "model.input_norm is 'per_image' there and 'none' here" in problem


def test_old_checkpoints_pass_and_an_evaluation_compares_the_network_only(tmp_path):
    (tmp_path / "trainer.json").write_text(json.dumps({"global_step": 3}))
    refuse_another_jobs_checkpoint(tmp_path, _fingerprint())  # written before fingerprints: nothing to compare
    (tmp_path / "trainer.json").write_text(json.dumps({"global_step": 3, "fingerprint": _fingerprint()}))
    refuse_another_jobs_checkpoint(tmp_path, _fingerprint(instances=5), model_only=True)
    with pytest.raises(ValueError, match="data.train_shards \\(samples\\) is 1438 there and 5 here"):
        refuse_another_jobs_checkpoint(tmp_path, _fingerprint(instances=5))
