"""`instcls bench step`: the real trainer's step on 2 CPU ranks, broken into phases that account
for the step's time, next to the loader measured alone."""

from pathlib import Path

import pytest

from trainer.bench.step_bench import PHASE_ORDER, StepBenchSettings, format_report, run

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def test_the_step_bench_breaks_the_step_into_phases_that_add_up_to_it():
    settings = StepBenchSettings(config=REPO / "configs" / "digits_cpu.yaml", ranks=2, steps=4, warmup=2,
                                 image_size=32)
    # channels_last on: the step feeds the network NHWC (its agreement with NCHW: test_backbone_layouts.py)
    result = run(settings, ["data.loader.batch_size=32", "checkpoint.every_steps=3", "model.channels_last=true"])
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    for rank in result["ranks"]:
        assert rank["steps"] == 4 and rank["images_per_s"] > 0 and rank["loader_images_per_s"] > 0
        phases = rank["phase_s"]
        assert set(phases) == set(PHASE_ORDER)
        assert all(phases[p] > 0 for p in ("forward", "objective", "backward", "optimizer")), phases
        assert phases["checkpoint"] > 0  # step 5 of 6 saved: one snapshot among the measured steps
        # on CPU ranks the phases are host time inside the step: together no more than the step
        inside = sum(phases[p] for p in ("data_wait", "forward", "objective", "backward", "optimizer"))
        assert 0.5 * rank["step_s_mean"] < inside <= rank["step_s_mean"] * 1.0001, (inside, rank)
        assert rank["loader_headroom"] == rank["loader_images_per_s"] / rank["images_per_s"]
    # A row per rank: its images/s, step time, each phase's seconds and the loader's headroom (the one
    # test of format_report's text).
    table = format_report(result).splitlines()
    for rank in result["ranks"]:
        (row,) = [line for line in table if line.split()[:3] == [str(rank["rank"]), f"{rank['images_per_s']:.1f}",
                                                                 f"{rank['step_s_mean']:.3f}"]]
        assert all(f"{rank['phase_s'][p]:.3f}(" in row for p in PHASE_ORDER), row
        assert row.endswith(f"{rank['loader_headroom']:.2f}x"), row
