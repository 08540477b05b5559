"""``logging.tensorboard``: which JSON-log numbers become which TensorBoard scalars, and the config's
refusal when the optional package is missing."""

import sys

import pytest

from tests.helpers.training import REPO
from trainer.config import ConfigError, load_job_config
from trainer.observability.record_sinks import scalars_of
from trainer.observability.tensorboard_scalars import open_tensorboard_scalars


def test_a_log_steps_numbers_become_train_scalars_at_its_step():
    """Nested keys are joined by "/"; the time, the event and the step itself are not scalars, nor
    are null (a skipped step's loss), booleans and text."""
    record = {"time": 1.5, "event": "step", "epoch": 0, "step": 7, "loss": None, "lr": 0.1, "images_per_s": 250.0,
              "memory_bytes": {"rss": 123456789}, "phase_seconds_per_step": {"forward": 0.25},
              "objective_comm_seconds": 0.0}
    assert scalars_of(record) == (7, {"train/epoch": 0.0, "train/lr": 0.1, "train/images_per_s": 250.0,
                                      "train/memory_bytes/rss": 123456789.0,
                                      "train/phase_seconds_per_step/forward": 0.25,
                                      "train/objective_comm_seconds": 0.0})


def test_evaluations_and_the_summary_have_sections_of_their_own_and_other_events_none():
    """An evaluation at its step (its digest and ``final`` flag left out); the summary at its last
    step (``steps``); messages, start lines and checks are not scalars."""
    evaluation = {"event": "eval", "epoch": 2, "step": 4, "final": True, "knn_trained": 0.5,
                  "query_features_digest": "ab12", "linear_curve": {"0.1": 0.25}, "seconds": 1.0}
    assert scalars_of(evaluation) == (4, {"eval/epoch": 2.0, "eval/knn_trained": 0.5, "eval/linear_curve/0.1": 0.25,
                                          "eval/seconds": 1.0})
    summary = {"event": "summary", "objective": "instance", "steps": 12, "images": 768, "peak_memory_kind": "rss"}
    assert scalars_of(summary) == (12, {"summary/steps": 12.0, "summary/images": 768.0})
    for event in ("message", "start", "epoch", "replicated", "consumed"):
        assert scalars_of({"event": event, "step": 3, "seconds": 1.0}) is None


def test_only_rank_0_writes_and_only_when_asked(tmp_path):
    """Off, or on another rank, nothing is opened (and the package is never imported)."""
    assert open_tensorboard_scalars(False, tmp_path, 0) is None
    assert open_tensorboard_scalars(True, tmp_path, 1) is None
    assert not (tmp_path / "tensorboard").exists()


def test_a_missing_tensorboard_package_is_refused_at_config_time_with_the_install_command(monkeypatch):
    """The message names the field and the fix; with the option off the package is not needed."""
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # what an environment without it finds
    config = REPO / "configs" / "demo_cpu.yaml"
    with pytest.raises(ConfigError) as refused:
        load_job_config(config, ["logging.tensorboard=true"])
    assert "logging.tensorboard=true" in str(refused.value)
    assert "pip install 'instcls[tensorboard]'" in str(refused.value)
    assert load_job_config(config).logging.tensorboard is False
