"""`bench ddp-vs-dhp`'s search, without ranks: N grows geometrically to the first failure, then
bisection narrows the bracket between the last fit and the first failure."""

from trainer.bench import ddp_vs_dhp
from trainer.bench.ddp_vs_dhp import SweepSettings, largest_fit, sweep


def test_growth_to_the_first_failure_then_bisection_converges_on_the_limit(monkeypatch):
    limit = 1_000_000  # the largest N a rank can hold, as a fake point runner sees it
    tried = []

    def fake_point(settings, mode, num_classes, worker=None):
        tried.append(num_classes)
        return dict(mode=mode, num_classes=num_classes, status="ok" if num_classes <= limit else "oom", ranks=[])

    monkeypatch.setattr(ddp_vs_dhp, "run_point", fake_point)
    points = sweep(SweepSettings(start_classes=100_000, growth=2.0, refine_steps=5), "dhp", progress=lambda line: None)
    assert tried[:5] == [100_000, 200_000, 400_000, 800_000, 1_600_000]  # doubling to the first failure
    bracket = [800_000, 1_600_000]
    for n in tried[5:]:  # each bisection point halves the bracket around the limit
        assert n == sum(bracket) // 2
        bracket = [n, bracket[1]] if n <= limit else [bracket[0], n]
    assert len(tried) == 10 and bracket[0] <= limit < bracket[1] and bracket[1] - bracket[0] == 800_000 // 32
    assert largest_fit(points) == bracket[0]

    tried.clear()
    # DDP's points here are instcls's alone (torch's op beside them: test_ddp_baseline.py).
    sweep(SweepSettings(start_classes=100_000, refine_steps=0, ddp_baseline="instcls"), "ddp",
          progress=lambda line: None)
    assert tried == [100_000, 200_000, 400_000, 800_000, 1_600_000]  # no bisection asked for
