"""`instcls bench ddp-vs-dhp --fake-devices`: the largest N of each mode found by executing the
classifier's step on fake CUDA devices, here at a small shape."""

from __future__ import annotations

import pytest

from trainer.bench.fake_device_sweep import (
    FakeSweep,
    _job,
    _rest_of_the_rank,
    executed_peak,
    format_table,
    largest_fitting,
    planned_largest,
)
from trainer.planning import GIB

SWEEP = FakeSweep(ranks=4, batch=64, dim=16, chunk_size=16384, growth=1.5, resolution=0.1)


@pytest.mark.integration
@pytest.mark.slow  # default suite: the same comparison under a real memory cap (test_ddp_vs_dhp.py)
def test_the_boundary_fits_and_a_little_more_does_not_and_dhp_fits_more_than_ddp():
    cap = _rest_of_the_rank(_job(SWEEP, "ddp"), SWEEP) + 32 * 2**20  # the backbone's share plus 32 MiB
    found, planned_n = {}, {}
    for mode in ("ddp", "dhp"):
        config = _job(SWEEP, mode)
        rest = _rest_of_the_rank(config, SWEEP)
        n = found[mode] = largest_fitting(mode, cap, SWEEP)
        assert executed_peak(config, SWEEP, n) + rest <= cap
        assert executed_peak(config, SWEEP, int(n * (1 + 2 * SWEEP.resolution))) + rest > cap
        planned = planned_n[mode] = planned_largest(mode, cap, SWEEP)  # the planner models the same step
        assert 0.75 < n / planned < 1.25, (mode, n, planned)
    assert found["dhp"] > 2 * found["ddp"]  # 4 shards, less the per-rank workspace
    rows = [{"cap_gib": cap / GIB, **{f"{m}_executed": found[m] for m in found},
             **{f"{m}_planned": planned_n[m] for m in found}}]
    # The table's rows for this cap show each mode's executed and planned N, then their ratios (the one
    # test of format_table's text).
    ddp, dhp, ratio = [line for line in format_table(rows, SWEEP).splitlines() if f"{rows[0]['cap_gib']:g} GiB" in line]
    for line, mode in ((ddp, "ddp"), (dhp, "dhp")):
        assert f"| {mode.upper()} | {found[mode] / 1e6:.1f}M | {planned_n[mode] / 1e6:.1f}M |" in line, line
    assert f"| {found['dhp'] / found['ddp']:.1f}x | {planned_n['dhp'] / planned_n['ddp']:.1f}x |" in ratio, ratio
