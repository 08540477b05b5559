"""`instcls plan` counts what top-K smoothing adds to a classifier step: the executed step on fake
CUDA devices (the dry run) and the plan of the same job agree within 10%.

Two shapes, each dominated by one part of what smoothing adds: a large batch on a small shard
(the fused backward's gathered target rows, three fp32 ``[B, 8, D]`` temporaries at a time) and a
small batch on a large shard (the hard-negative table and its inversion, ``N/T * K`` entries each)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.config import load_job_config
from trainer.dry_run.job import dry_run_job, format_result

IN21K = Path(__file__).resolve().parents[2] / "configs" / "in21k_r50_64gpu.yaml"


@pytest.mark.parametrize("num_instances, ranks, batch_per_rank", [
    (8_000, 4, 1024),  # B = 8192 scored samples against 2,000 rows per rank: the target passes dominate
    (160_000, 8, 32),  # B = 512 against 20,000 rows per rank (x 100 negatives): the tables dominate
])
def test_the_plan_of_a_smoothing_job_matches_its_dry_run_within_10_percent(num_instances, ranks, batch_per_rank):
    config = load_job_config(IN21K, [f"data.loader.batch_size={batch_per_rank}"])
    assert config.objective.smoothing_alpha > 0 and config.objective.top_k == 100
    result = dry_run_job(config, num_instances, world_size=ranks, rank=1, compare=[1], steps=2)
    text = format_result(result, config, IN21K.name)
    assert result.clean and result.planned["top-K smoothing (hard negatives, targets)"] > 0, text
    assert abs(result.report.peak_bytes / result.planned_objective - 1) < 0.10, text
