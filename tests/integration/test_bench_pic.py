"""`instcls bench pic` in miniature: PIC points with a disk store next to the full softmax, which
runs where it fits and fails to allocate where it does not (the paper's Appendix E)."""

import pytest

from trainer.bench.pic_bench import MIB, PicBenchSettings, format_report, run

pytestmark = pytest.mark.integration


@pytest.mark.slow  # default suite: PIC's step and store in test_pic_multirank.py and test_pic_training.py
def test_bench_pic_reports_flat_memory_next_to_the_full_softmax(tmp_path):
    settings = PicBenchSettings(sizes=("4000", "600000"), batch=16, queue=512, steps=2, warmup=1, cap_gib=0.2,
                                full_max_classes=4000, store_dir=str(tmp_path / "stores"))
    report = run(settings, progress=lambda line: None)
    pic_small, pic_large = report.sampled
    full_small, full_large = report.full
    assert pic_small["status"] == pic_large["status"] == "ok", report.sampled
    assert pic_large["store_bytes"] >= 600000 * 128 * 4 * 2  # W and momentum went to disk...
    assert pic_large["peak_anon_bytes"] < 600000 * 128 * 4  # ...not into anonymous memory
    assert full_small["status"] == "ok" and full_small["step_s"] > 0
    assert full_large["status"] == "oom", full_large  # 600k x 128 fp32 rows alone exceed 0.2 GiB
    assert not (tmp_path / "stores" / "store-600000").exists()  # each store is removed after its point
    summary = report.summary()
    assert summary["from_to"] == [4000, 600000] and summary["memory_growth"] > 0
    # A row per N with PIC's figures and the full softmax's (the one test of format_report's text).
    text = format_report(report)
    for pic, full in zip(report.sampled, report.full):
        (row,) = [line for line in text.splitlines() if line.startswith(f"| {pic['num_classes']:,} |")]
        assert f"| {pic['step_s']:.3f} | {pic['peak_anon_bytes'] / MIB:,.0f} |" in row, row
        assert (f"| {full['step_s']:.3f} |" if full["status"] == "ok" else f"| {full['status'].upper()} |") in row, row
    assert f"x{summary['memory_growth']:.3f}" in text
