"""DDP's code in `bench ddp-vs-dhp`: the faster of instcls's replicated classifier and torch's own op.

DHP is compared with the best single-device code a user has for the replicated classifier: at
each N, instcls's DDP mode and torch's ``F.linear_cross_entropy`` (its fastest setting under the
same cap, ``trainer.bench.torch_op_point``) both run, and DDP's point is the one of them that fits
with the shorter worst-rank step.  The point's ``baseline`` names it and ``baselines`` keeps both
outcomes for the table.
"""

from __future__ import annotations

INSTCLS = "instcls"


def worst_step(point: dict) -> float:
    return max(r["step_s"] for r in point["ranks"])


def torch_name(torch_point: dict) -> str:
    return f"torch {torch_point['setting']}" if torch_point["setting"] else "torch"


def faster_baseline(instcls: dict, torch_point: dict) -> dict:
    """DDP's point from instcls's (``run_point``'s) and torch's (``run_torch_point``'s) at one N."""
    candidates = {INSTCLS: instcls, torch_name(torch_point): torch_point}
    outcomes = {name: dict(status=p["status"], step_s=worst_step(p) if p["status"] == "ok" else None)
                for name, p in candidates.items()}
    fits = {name: p for name, p in candidates.items() if p["status"] == "ok"}
    if not fits:
        status = "oom" if "oom" in {p["status"] for p in candidates.values()} else "failed"
        return dict(instcls, status=status, baseline=None, baselines=outcomes)
    name = min(fits, key=lambda n: outcomes[n]["step_s"])
    return dict(fits[name], mode="ddp", baseline=name, baselines=outcomes)


def describe(point: dict) -> str:
    """A point's status, and for DDP's point with both baselines, both steps and which was chosen."""
    if "baselines" not in point:
        return point["status"]
    steps = ", ".join(f"{name} {o['step_s']:.3f} s" if o["step_s"] is not None else f"{name} {o['status']}"
                      for name, o in point["baselines"].items())
    return f"{point['status']} ({steps}: {point['baseline'] or 'neither fits'})"


def baseline_lines(ddp_points: list[dict]) -> list[str]:
    """The table's account of DDP's code at each N measured."""
    compared = sorted((p for p in ddp_points if "baselines" in p), key=lambda p: p["num_classes"])
    if not compared:
        return []
    return ["", "DDP's code at each N, the faster that fits of instcls's replicated classifier and torch's "
            "linear_cross_entropy (its fastest setting under the cap):"] + [
        f"- N={p['num_classes']:,}: {describe(p)}" for p in compared]
