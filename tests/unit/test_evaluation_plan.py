"""`instcls plan --config` prints how long the evaluation's feature extraction takes, from a stated
images/s per rank; the ImageNet-21K job caps its kNN bank so that the end-of-run evaluation does not
extract all 14.2M training images for each of its two networks."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from trainer.cli import main
from trainer.config import load_job_config
from trainer.planning.evaluation_plan import evaluation_plan_lines

IN21K = Path(__file__).resolve().parents[2] / "configs" / "in21k_r50_64gpu.yaml"
IN21K_IMAGES = 14_197_122
TIME_LINE = re.compile(
    r"time at the end: (\d+) networks \(trained, random init\) x \(bank ([\d,]+) \+ queries ([\d,]+)\) images at "
    r"([\d,]+) images/s per rank over (\d+) ranks ≈ ([\d.,]+) (s|min|h) of feature extraction"
)
SECONDS_PER = {"s": 1, "min": 60, "h": 3600}


def _time_line(lines: list[str]) -> re.Match:
    found = [match for line in lines if (match := TIME_LINE.search(line))]
    assert len(found) == 1, "\n".join(lines)
    return found[0]


def _printed_seconds(match: re.Match) -> tuple[float, float]:
    """The printed duration in seconds, and half its last printed digit (the rounding) in seconds."""
    unit = SECONDS_PER[match.group(7)]
    return float(match.group(6).replace(",", "")) * unit, 0.05 * unit


def _numbers(match: re.Match) -> tuple[int, ...]:
    return tuple(int(match.group(i).replace(",", "")) for i in range(1, 6))


def test_the_in21k_job_extracts_a_million_image_bank_in_seconds_not_the_whole_set_in_minutes():
    config = load_job_config(IN21K)
    assert config.eval.bank_samples == 1_000_000 and config.eval.knn_at_end
    # No eval shards here: the plan assumes ImageNet's 50,000 held-out images.  Worked by hand:
    # 2 networks x (1,000,000 + 50,000) images / (3,500 images/s x 64 ranks) = 2,100,000 / 224,000 = 9.375 s.
    capped = _time_line(evaluation_plan_lines(config, 64, IN21K_IMAGES))
    assert _numbers(capped) == (2, 1_000_000, 50_000, 3_500, 64)
    seconds, rounding = _printed_seconds(capped)
    assert abs(seconds - 9.375) <= rounding, capped.group(0)
    # The whole set: 2 x 14,247,122 / 224,000 = 127.2 s, printed in minutes.
    whole = replace(config, eval=replace(config.eval, bank_samples=None))
    uncapped = _time_line(evaluation_plan_lines(whole, 64, IN21K_IMAGES))
    assert _numbers(uncapped)[1] == IN21K_IMAGES and uncapped.group(7) == "min"
    seconds, rounding = _printed_seconds(uncapped)
    assert abs(seconds - 2 * (IN21K_IMAGES + 50_000) / 224_000) <= rounding, uncapped.group(0)


@pytest.mark.parametrize("images_per_second, ranks", [(1_000, 64), (250, 8)])
def test_the_rate_and_the_ranks_scale_the_time(images_per_second, ranks):
    lines = evaluation_plan_lines(load_job_config(IN21K), ranks, IN21K_IMAGES, images_per_second)
    match = _time_line(lines)
    assert _numbers(match) == (2, 1_000_000, 50_000, images_per_second, ranks)
    seconds, rounding = _printed_seconds(match)
    expected = {(1_000, 64): 2_100_000 / 64_000, (250, 8): 2_100_000 / 2_000}[(images_per_second, ranks)]
    assert abs(seconds - expected) <= rounding, match.group(0)


def test_the_command_line_takes_the_rate_from_its_flag(capsys):
    assert main(["plan", "--config", str(IN21K), "--ranks", "64", "--num-classes", str(IN21K_IMAGES),
                 "--eval-images-per-second", "1000"]) == 0
    match = _time_line(capsys.readouterr().out.splitlines())
    assert _numbers(match)[3] == 1_000
    seconds, rounding = _printed_seconds(match)
    assert abs(seconds - 2_100_000 / 64_000) <= rounding, match.group(0)  # 32.8 s


def test_without_an_end_of_run_evaluation_only_the_evaluations_while_training_are_timed():
    config = load_job_config(IN21K, ["eval.knn_at_end=false", "eval.every_epochs=5"])
    lines = evaluation_plan_lines(config, 64, IN21K_IMAGES)
    assert any("time at the end: none (eval.knn_at_end and eval.linear_at_end are false)" in line for line in lines)
    every = [line for line in lines if "every 5 epoch(s) while training" in line]
    # one network a time: 1,050,000 / 224,000 = 4.6875 s
    assert len(every) == 1 and "the trained network, 4.7 s each" in every[0], lines
