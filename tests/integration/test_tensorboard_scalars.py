"""`logging.tensorboard: true` on 2 CPU ranks: rank 0's TensorBoard events, read back with
TensorBoard's own reader, hold every number its JSON log recorded, at the same steps."""

import json

import numpy as np
import pytest

from tests.helpers.training import run_train

pytestmark = pytest.mark.integration

TINY_RUN = ["optim.epochs=2", "eval.every_epochs=1", "eval.knn_at_end=true", "logging.log_every=1",
            "logging.metrics_port=0", "logging.tensorboard=true"]


def _numbers(tag: str, value, into: dict[str, float]) -> None:
    """The JSON record's numbers by TensorBoard tag: keys joined by "/" (no bools, no nulls, no text)."""
    if isinstance(value, dict):
        for key, item in value.items():
            _numbers(f"{tag}/{key}", item, into)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        into[tag] = value


def _json_series(log_file) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` of the step, eval and summary records of one rank's JSON log."""
    series: dict[str, list[tuple[int, float]]] = {}
    sections = {"step": "train", "eval": "eval", "summary": "summary"}
    for record in map(json.loads, log_file.read_text().splitlines()):
        if record["event"] not in sections:
            continue
        step = record["step"] if "step" in record else record["steps"]
        numbers: dict[str, float] = {}
        for key, value in record.items():
            if key not in ("time", "event", "step"):
                _numbers(f"{sections[record['event']]}/{key}", value, numbers)
        for tag, value in numbers.items():
            series.setdefault(tag, []).append((step, value))
    return series


@pytest.mark.slow  # default suite: test_mlflow_tracking.py's run writes TensorBoard events and checks them too
def test_tensorboard_holds_every_scalar_of_rank_0s_json_log(tiny_digits_split, tmp_path):
    """Two epochs of 2 steps with a kNN evaluation after each (the last with the linear probe): every
    numeric series of rank 0's step, eval and summary records (loss, lr, images/s, phase seconds,
    memory, kNN, the probe's curve, throughput, peak memory) is a TensorBoard series of the same tag,
    steps and float32 values, and no other rank wrote event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_train(tmp_path, tiny_digits_split, 2, TINY_RUN, config="demo_cpu.yaml")

    event_files = sorted(tmp_path.rglob("events.out.tfevents.*"))
    assert len(event_files) == 1 and event_files[0].parent == tmp_path / "logs" / "tensorboard", event_files
    events = EventAccumulator(str(event_files[0].parent), size_guidance={"scalars": 0})  # 0: keep every event
    events.Reload()
    written = {tag: [(event.step, event.value) for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}

    expected = _json_series(tmp_path / "logs" / "rank-00000.jsonl")
    assert sorted(written) == sorted(expected)
    for tag, points in expected.items():
        assert [step for step, _ in written[tag]] == [step for step, _ in points], tag
        assert np.array_equal(np.float32([v for _, v in written[tag]]), np.float32([v for _, v in points])), tag
    for tag in ("train/loss", "train/lr", "train/images_per_s", "train/phase_seconds_per_step/forward",
                "train/memory_bytes/rss", "eval/knn_trained", "eval/knn_random_init", "eval/linear_curve/0.1",
                "summary/images", "summary/peak_memory_bytes"):
        assert tag in written, sorted(written)
    assert [step for step, _ in written["train/loss"]] == [1, 2, 3, 4]
    assert [step for step, _ in written["eval/knn_trained"]] == [2, 4]  # after epoch 1, and the final one
