"""`bench ddp-vs-dhp`'s DDP is the faster of instcls's replicated classifier and torch's op at each N
(the one that fits when only one does), and the table says which; without processes: both sides'
points are faked with the steps and outcomes each case needs."""

from trainer.bench import ddp_vs_dhp, torch_op_point
from trainer.bench.ddp_vs_dhp import fixed_points, format_table, summarize
from trainer.bench.settings.ddp_vs_dhp import SweepSettings

GIB = 2**30


def _point(mode, n, status, step_s, **extra):
    ranks = [dict(rank=r, status=status, step_s=step_s, compute_s=step_s, comm_s=0.0, peak_bytes=GIB,
                  peak_above_baseline_bytes=GIB // 2) for r in range(2)] if status == "ok" else []
    return dict(mode=mode, num_classes=n, status=status, ranks=ranks, **extra)


# N -> (instcls's outcome and step, torch's fastest setting, outcome and step)
CASES = {
    1000: (("ok", 0.30), ("chunk 128", "ok", 0.20)),  # torch faster
    2000: (("ok", 0.30), ("chunk 32", "ok", 0.45)),  # instcls faster
    4000: (("ok", 0.60), (None, "oom", None)),  # only instcls fits
    8000: (("oom", None), (None, "oom", None)),  # neither
}


def _fake_sides(monkeypatch):
    ran = []

    def classifier_point(settings, mode, n, worker=None):
        ran.append(("instcls", mode, n))
        status, step = CASES[n][0] if mode == "ddp" else ("ok", 0.1)
        return _point(mode, n, status, step)

    def torch_point(settings, n):
        ran.append(("torch", "ddp", n))
        setting, status, step = CASES[n][1]
        return _point("ddp", n, status, step, setting=setting, torch_settings=[])

    monkeypatch.setattr(ddp_vs_dhp, "run_point", classifier_point)
    monkeypatch.setattr(torch_op_point, "run_torch_point", torch_point)
    return ran


def test_ddp_points_take_the_faster_baseline_that_fits_and_the_table_names_it(monkeypatch):
    ran = _fake_sides(monkeypatch)
    settings = SweepSettings(ranks=2)
    progress = []
    points = {mode: fixed_points(settings, mode, list(CASES), progress.append) for mode in ("ddp", "dhp")}
    ddp = {p["num_classes"]: p for p in points["ddp"]}
    assert {n: p["baseline"] for n, p in ddp.items()} == {1000: "torch chunk 128", 2000: "instcls", 4000: "instcls",
                                                          8000: None}
    assert [ddp[n]["status"] for n in CASES] == ["ok", "ok", "ok", "oom"]
    assert ddp[1000]["ranks"][0]["step_s"] == 0.20 and ddp[2000]["ranks"][0]["step_s"] == 0.30
    # DHP is instcls's alone: torch's op ran at DDP's points only.
    assert {(side, mode) for side, mode, _ in ran} == {("instcls", "ddp"), ("torch", "ddp"), ("instcls", "dhp")}
    assert " ddp N=       1,000: ok (instcls 0.300 s, torch chunk 128 0.200 s: torch chunk 128)" in progress

    table = format_table(settings, points, summarize(settings, points))
    assert "| DDP (replicated W, instcls) | 4,000 | 8,000 |" in table  # the largest N DDP trains, and by whom
    assert "- N=1,000: ok (instcls 0.300 s, torch chunk 128 0.200 s: torch chunk 128)" in table
    assert "- N=4,000: ok (instcls 0.600 s, torch oom: instcls)" in table
    assert "- N=8,000: oom (instcls oom, torch oom: neither fits)" in table


def test_without_the_torch_baseline_ddp_is_instcls_alone(monkeypatch):
    ran = _fake_sides(monkeypatch)
    points = fixed_points(SweepSettings(ranks=2, ddp_baseline="instcls"), "ddp", [1000])
    assert [side for side, _, _ in ran] == ["instcls"] and "baseline" not in points[0]
    ran.clear()
    fixed_points(SweepSettings(ranks=2, backbone="resnet18"), "ddp", [1000])  # torch's op has no backbone
    assert [side for side, _, _ in ran] == ["instcls"]
