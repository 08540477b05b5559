"""`instcls bench classifier --peer torch`: instcls's classifier beside torch's own fused op
(``F.linear_cross_entropy``) on the same problem: N rows, a batch of B ids, features of width D,
cosine logits at instcls's temperature, plain cross entropy (``trainer.bench.torch_op``).

Two layouts, each side in fresh processes under the same per-rank memory cap (as `bench
ddp-vs-dhp` caps a point; on CPU the capped ranks compute on one thread each):
- T = 1: instcls updates the rows inside its backward (their gradient never exists whole, its
  ``update_in_backward``); torch's op always materialises the ``N x D`` gradient, then the same
  SGD updates the rows.
- T = --ranks, replicated (DDP): every rank holds all rows and scores its B / T samples; both sides
  average the rows' gradient over the ranks before the update.
Each step is timed with the update of the rows.  torch's figure is the fastest of its settings that
fit the cap (``--torch-settings``), named in the report.  Before the figures, a check that both
compute the same loss and gradients (``trainer.bench.torch_op_check``).
"""

from __future__ import annotations

from dataclasses import asdict

import torch

from trainer.bench.ddp_vs_dhp import run_point
from trainer.bench.settings.classifier import ClassifierBenchSettings
from trainer.bench.settings.ddp_vs_dhp import SweepSettings
from trainer.bench.settings.torch_peer import TorchPeerSettings
from trainer.bench.torch_op import auto_batch_chunk, require_linear_cross_entropy
from trainer.bench.torch_op_check import run_check
from trainer.bench.torch_op_point import run_torch_point

MIB = 2**20


def sweep_settings(settings: ClassifierBenchSettings, peer: TorchPeerSettings, ranks: int) -> SweepSettings:
    """One layout as a capped DDP-vs-DHP point (``run_point``: instcls's classifier; ``run_torch_point``:
    torch's op), the update inside instcls's backward where it can be (one rank)."""
    return SweepSettings(ranks=ranks, batch=settings.batch, dim=settings.dim, chunk_size=settings.chunk_size,
                         cap_gib=peer.cap_gib, steps=settings.steps, warmup=settings.warmup, dtype=settings.dtype,
                         update_in_backward=ranks == 1, torch_settings=peer.torch_settings)


def _raise_on_error(side: str, point: dict) -> None:
    """An allocation failure under the cap is a result; any other failure is a fault to show."""
    failed_settings = [s for s in point.get("torch_settings", []) if s["status"] == "failed"]
    if point["status"] == "failed" or failed_settings:
        messages = [r["message"] for r in [*point["ranks"], *failed_settings] if r.get("message")]
        raise RuntimeError(f"{side} failed at N={point['num_classes']:,}: {'; '.join(messages) or 'a rank died'}")


def per_rank(ours: dict, theirs: dict) -> list[dict]:
    """Each rank's step and peak above its baseline on both sides, and torch's over instcls's."""
    torch_by_rank = {r["rank"]: r for r in theirs["ranks"]}
    rows = []
    for mine in sorted(ours["ranks"], key=lambda r: r["rank"]):
        other = torch_by_rank[mine["rank"]]
        rows.append(dict(
            rank=mine["rank"], instcls_step_s=mine["step_s"], torch_step_s=other["step_s"],
            step_ratio=other["step_s"] / mine["step_s"],
            instcls_peak_mib=mine["peak_above_baseline_bytes"] / MIB,
            torch_peak_mib=other["peak_above_baseline_bytes"] / MIB,
            memory_ratio=other["peak_above_baseline_bytes"] / mine["peak_above_baseline_bytes"],
        ))
    return rows


def measure_layout(settings: ClassifierBenchSettings, peer: TorchPeerSettings, ranks: int) -> dict:
    sweep = sweep_settings(settings, peer, ranks)
    mode = "dhp" if ranks == 1 else "ddp"  # one rank: the whole classifier either way
    ours = run_point(sweep, mode, settings.num_classes)
    _raise_on_error("instcls's classifier", ours)
    theirs = run_torch_point(sweep, settings.num_classes)
    _raise_on_error("torch's linear_cross_entropy", theirs)
    both = ours["status"] == "ok" and theirs["status"] == "ok"
    return dict(ranks=ranks, instcls=dict(ours, update_in_backward=sweep.update_in_backward),
                torch=theirs, per_rank=per_rank(ours, theirs) if both else [])


def run(settings: ClassifierBenchSettings, peer: TorchPeerSettings, progress=print) -> dict:
    require_linear_cross_entropy()
    if torch.cuda.is_available() and torch.cuda.device_count() < settings.ranks:
        raise ValueError(f"--ranks {settings.ranks} needs that many GPUs; this machine has "
                         f"{torch.cuda.device_count()}")
    settings = settings.on_this_machine()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, settings.dtype)
    layouts = []
    for ranks in sorted({1, settings.ranks}):
        progress(f"T={ranks}: instcls's classifier, then torch's op with {','.join(peer.torch_settings)} ...")
        layouts.append(measure_layout(settings, peer, ranks))
    single = layouts[0]["torch"]
    check = None
    if single["as_setting"] is not None:
        progress(f"checking loss and gradients against torch's {single['setting']} ...")
        check = run_check(settings.num_classes, settings.batch, settings.dim, settings.dtype, settings.chunk_size,
                          single["as_setting"])
    return dict(
        settings=asdict(settings), peer=asdict(peer), device=device.type, torch_version=torch.__version__,
        auto_batch_chunk=auto_batch_chunk(settings.batch, settings.num_classes, settings.dim, dtype, device),
        agreement=check, layouts=layouts,
    )


def _rows(side: str, setting: str, status: str, ranks: list[dict]) -> str:
    step = f"{max(r['step_s'] for r in ranks):.3f}" if status == "ok" else "-"
    peak = f"{max(r['peak_bytes'] for r in ranks) / MIB:,.0f}" if status == "ok" else "-"
    above = f"{max(r['peak_above_baseline_bytes'] for r in ranks) / MIB:,.0f}" if status == "ok" else "-"
    return f"  {side:<9}{setting:<20}{status:<11}{step:>9}{peak:>11}{above:>15}"


def format_report(summary: dict) -> str:
    s, peer = summary["settings"], summary["peer"]
    batch, n = s["batch"], s["num_classes"]
    lines = [
        f"instcls's classifier vs torch's F.linear_cross_entropy (torch {summary['torch_version']}): N={n:,} "
        f"B={batch} D={s['dim']} dtype={s['dtype']} chunk={s['chunk_size']} on {summary['device']}, "
        f"cap {peer['cap_gib']:g} GiB per rank; mean of {s['steps']} steps after {s['warmup']} warm-up, each with "
        "the update of the rows",
        f"torch's chunking_method='auto' here picks batch_chunk_size {summary['auto_batch_chunk']}: "
        f"{-(-batch // summary['auto_batch_chunk'])} chunks, each reading all {n:,} x {s['dim']} of W",
    ]
    check = summary["agreement"]
    if check is None:
        lines.append("agreement: not checked (no setting of torch's op fits the cap at T=1)")
    else:
        errors = ", ".join(f"{name.replace('_', ' ')} {error:.1e}" for name, error in check["errors"].items())
        lines.append(f"agreement at T=1 (instcls, rows updated after the backward, vs torch's {check['setting']}): "
                     f"{errors} relative (tolerance {check['tolerance']:.0e}): "
                     + ("agree" if check["agree"] else "DISAGREE"))
    for layout in summary["layouts"]:
        ours, theirs = layout["instcls"], layout["torch"]
        how = "rows updated inside the backward" if ours["update_in_backward"] else "rows updated after the backward"
        title = f"T={layout['ranks']}" + (" replicated (DDP)" if layout["ranks"] > 1 else "")
        lines += ["", f"{title}: instcls {ours['mode']}, {how}; worst rank",
                  f"  {'side':<9}{'setting':<20}{'status':<11}{'step s':>9}{'peak MiB':>11}{'peak-base MiB':>15}",
                  _rows("instcls", "-", ours["status"], ours["ranks"])]
        lines += [_rows("torch", t["setting"], t["status"], t["ranks"]) for t in theirs["torch_settings"]]
        lines.append(f"  torch's fastest under the cap: {theirs['setting'] or 'none fits'}")
        for row in layout["per_rank"]:
            lines.append(
                f"  rank {row['rank']}: step {row['instcls_step_s']:.3f} s instcls, {row['torch_step_s']:.3f} s torch: "
                f"{row['step_ratio']:.2f}x; peak-base {row['instcls_peak_mib']:,.0f} MiB instcls, "
                f"{row['torch_peak_mib']:,.0f} MiB torch: {row['memory_ratio']:.2f}x (torch over instcls)")
    return "\n".join(lines)

