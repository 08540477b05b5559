"""On a GPU node: the dry run's step executed on the real device agrees with what the fake devices
predicted (peak memory within 15% or 64 MiB, and no host sync after the first step)."""

from __future__ import annotations

import pytest

from trainer.bench.fake_device_sweep import FakeSweep, _job
from trainer.dry_run.job import dry_run_job
from trainer.dry_run.on_device import run_rank_on_device

pytestmark = pytest.mark.integration


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["dhp", "ddp"])
def test_the_device_measures_what_the_dry_run_predicted(mode):
    sweep = FakeSweep(ranks=64, batch=4096, chunk_size=65536)
    config, num_classes = _job(sweep, mode), 64 * 50_000
    predicted = dry_run_job(config, num_classes, 64, 0, [0], steps=3).report
    measured = run_rank_on_device(config, num_classes, 64, 0, steps=3)
    assert measured.report.stopped is None, measured.report.stopped
    assert not measured.steady_syncs(), measured.steady_syncs()
    assert abs(measured.report.peak_bytes - predicted.peak_bytes) <= max(0.15 * predicted.peak_bytes, 64 << 20), (
        measured.report.peak_bytes, predicted.peak_bytes)
