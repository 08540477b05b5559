"""`instcls bench step`: the real trainer's step on 2 CPU ranks, broken into phases that account
for the step's time, next to the loader measured alone; with ``--baseline``, next to the job's
network in a plain PyTorch loop."""

import json
from pathlib import Path

import pytest

from trainer.bench.step_bench import PHASE_ORDER, StepBenchSettings, format_report, run

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # the default run covers `bench step` with the baseline below
def test_the_step_bench_breaks_the_step_into_phases_that_add_up_to_it():
    settings = StepBenchSettings(config=REPO / "configs" / "digits_cpu.yaml", ranks=2, steps=4, warmup=2,
                                 image_size=32, data="loader")
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
        cells = [str(rank["rank"]), "job", f"{rank['images_per_s']:.1f}", f"{rank['step_s_mean']:.3f}"]
        (row,) = [line for line in table if line.split()[:4] == cells]
        assert all(f"{rank['phase_s'][p]:.3f}(" in row for p in PHASE_ORDER), row
        assert row.endswith(f"{rank['loader_headroom']:.2f}x"), row


def test_the_baseline_runs_the_jobs_network_plainly_beside_the_jobs_step(tmp_path):
    """Both runs on the same ranks and synthetic batch: the job's images/s over the baseline's, per
    phase the ops each dispatches, and the training thread's waits for the device.  The same network
    on the same views dispatches the same forward ops; the baseline's optimizer steps on torch's
    foreach kernels.  The job runs with DeepSpeed's throughput timer turned back on, so its two
    waits a step (from step 3) show, named, where the baseline has none: on CPU ranks too."""
    timer_on = tmp_path / "zero0_timer.json"
    timer_on.write_text(json.dumps({**json.loads((REPO / "ds_configs" / "zero0.json").read_text()),
                                    "timers": {"throughput": {"enabled": True}}}))
    settings = StepBenchSettings(config=REPO / "configs" / "demo_cpu.yaml", ranks=2, steps=2, warmup=2,
                                 image_size=32, baseline=True)
    # no contrastive prior: a start-up pass over the shards that no step runs
    result = run(settings, ["data.loader.batch_size=16", "objective.contrastive_prior=false",
                            f"deepspeed_config={timer_on}"])
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    for rank in result["ranks"]:
        job, baseline = rank, rank["baseline"]
        assert job["images_per_s"] > 0 and baseline["images_per_s"] > 0 and baseline["steps"] == 2
        assert rank["job_over_baseline"] == job["images_per_s"] / baseline["images_per_s"]
        assert "loader_images_per_s" not in rank  # data synthetic: the loader is not what is measured
        assert job["phase_s"]["data_wait"] < 0.01  # the batch is already on the device
        for run_ in (job, baseline):
            assert all(run_["kernels"][phase] > 0 for phase in ("forward", "backward", "optimizer")), run_["kernels"]
        assert baseline["kernels"]["forward"] == job["kernels"]["forward"]
        assert baseline["kernel_ops"]["forward"] == job["kernel_ops"]["forward"]
        assert baseline["precision"] == "fp32"  # ds_configs/zero0.json
        assert baseline["kernel_ops"]["optimizer"].keys() <= {"aten._foreach_add_.List", "aten._foreach_add.List",
                                                              "aten._foreach_mul_.Scalar"}
        assert job["host_syncs_per_step"] == 2 and sum(job["host_syncs"].values()) == 2, job["host_syncs"]
        assert all("deepspeed/utils/timer.py" in site for site in job["host_sync_sites_per_step"]), job
        assert sum(baseline["host_syncs"].values()) == 0, baseline["host_syncs"]
    text = format_report(result)
    first = result["ranks"][0]
    assert "rank 0: 2.0, rank 1: 2.0" in text
    assert f"rank 0 {first['job_over_baseline']:.2f}x" in text
    (row,) = [line for line in text.splitlines() if line.split()[:3] == ["0", "baseline",
                                                                        f"{first['baseline']['images_per_s']:.1f}"]]

