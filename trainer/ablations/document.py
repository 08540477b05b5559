"""docs/ablations.md and its PNG, written from a sweep's results: every number in them is measured
by `instcls ablate`; the prose around them comes from the catalogue."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

from trainer.ablations.catalogue import Ablation
from trainer.ablations.runner import RunResult, SweepSettings
from trainer.ablations.verdict import Verdict, accuracy, judge, summarise


@dataclass(frozen=True)
class Sweep:
    settings: SweepSettings
    ablations: tuple[Ablation, ...]
    results: list[RunResult]
    command: str

    def of(self, ablation: Ablation) -> list[RunResult]:
        return [r for r in self.results if r.ablation == ablation.name]

    def eval_epochs(self, ablation: Ablation) -> list[int]:
        return sorted({epoch for r in self.of(ablation) for epoch in r.knn_by_epoch})


def _cell(stats) -> str:
    return "-" if stats is None else str(stats)


def ablation_table(sweep: Sweep, ablation: Ablation) -> list[str]:
    """One row per variant: kNN at each evaluation epoch (the last is the end), images/s and the
    wall time of one run."""
    epochs = sweep.eval_epochs(ablation)
    header = ["variant", *(f"kNN % @ epoch {e}" for e in epochs), "images/s", "s per run"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for variant in ablation.variants:
        runs = [r for r in sweep.of(ablation) if r.variant == variant.label]
        if not runs:
            continue
        cells = [_cell(accuracy(sweep.results, ablation, variant.label, e)) for e in epochs]
        speed = sum(r.images_per_s for r in runs) / len(runs)
        seconds = sum(r.wall_seconds for r in runs) / len(runs)
        lines.append(f"| {variant.label} | " + " | ".join(cells) + f" | {speed:.0f} | {seconds:.0f} |")
    return lines


def summary_table(sweep: Sweep, verdicts: dict[str, list[Verdict]]) -> list[str]:
    lines = ["| ablation | source | the paper's direction | measured (points, claimed direction) | verdict |",
             "|---|---|---|---|---|"]
    for ablation in sweep.ablations:
        for verdict in verdicts[ablation.name]:
            measured = "-" if verdict.difference is None else f"{verdict.difference:+.2f} ± {verdict.noise:.2f}"
            lines.append(f"| {ablation.name} | {ablation.source} | {verdict.claim.describe()} | {measured} | "
                         f"**{verdict.outcome}** |")
    return lines


def verdicts_of(sweep: Sweep) -> dict[str, list[Verdict]]:
    return {a.name: [judge(claim, a, sweep.results) for claim in a.claims] for a in sweep.ablations}


def render(sweep: Sweep, png_name: str) -> str:
    verdicts = verdicts_of(sweep)
    random_init = summarise([r.knn_random_init for r in sweep.results])
    runs = {r.run: r for r in sweep.results}  # identical variants of several ablations are one run
    minutes = sum(r.wall_seconds for r in runs.values()) / 60
    seeds = sorted({r.seed for r in sweep.results})
    epochs = sorted({r.epochs for r in sweep.results})
    lines = [
        "# Ablations in miniature",
        "",
        f"Written by `{sweep.command}` from {len(runs)} training runs ({minutes:.1f} minutes of training "
        f"jobs) on {os.cpu_count()} CPU cores ({platform.machine()}), {sweep.settings.nproc} ranks per run. "
        f"Each run trains {', '.join(map(str, epochs))} epochs on the demo's digit scenes (`make demo`) with the "
        f"demo's recipe, changing only what its ablation is about; seeds {', '.join(map(str, seeds))} for every "
        "variant, fixed before any result was seen.",
        "",
        "Every accuracy is the held-out split's kNN (k = 20, cosine, temperature-weighted) in %, mean ± std "
        f"over the seeds.  The same networks at random initialisation score {random_init}.  A difference "
        "counts as reproducing the paper only when it is larger than the seeds' noise (the standard error "
        "of the difference of the two means); smaller ones are reported as within seed noise.",
        "",
        "## Summary",
        "",
        *summary_table(sweep, verdicts),
        "",
        f"![kNN accuracy of every variant]({png_name})",
        "",
    ]
    for ablation in sweep.ablations:
        lines += [f"## {ablation.title}", "", f"*{ablation.source}.* {ablation.published}"]
        if ablation.note:
            lines += ["", ablation.note]
        lines += ["", *ablation_table(sweep, ablation), ""]
        lines += [f"- {verdict.describe()}" for verdict in verdicts[ablation.name]]
        lines.append("")
    return "\n".join(lines)


def plot(sweep: Sweep, path: Path) -> Path:
    """One panel per ablation: final kNN per variant (mean, std over seeds as error bars, the random
    init as a dashed line), or kNN per evaluation epoch for ablations about the course of training."""
    import matplotlib

    matplotlib.use("Agg")  # no display in a container
    import matplotlib.pyplot as plt

    columns = min(4, len(sweep.ablations))
    rows = -(-len(sweep.ablations) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.6 * rows), squeeze=False)
    for axis in axes.flat[len(sweep.ablations):]:
        axis.set_visible(False)
    for axis, ablation in zip(axes.flat, sweep.ablations):
        random_init = summarise([r.knn_random_init for r in sweep.of(ablation)]).mean  # the dashed line
        if ablation.curves:
            epochs = sweep.eval_epochs(ablation)
            for variant in ablation.variants:
                points = [(e, s) for e in epochs if (s := accuracy(sweep.results, ablation, variant.label, e))]
                axis.errorbar([e for e, _ in points], [s.mean for _, s in points], [s.std for _, s in points],
                              marker="o", capsize=3, label=variant.label)
            axis.set_xlabel("epoch")
            axis.legend(fontsize=8)
        else:
            labels = [v.label for v in ablation.variants]
            stats = [accuracy(sweep.results, ablation, label) for label in labels]
            shown = [(label, s) for label, s in zip(labels, stats) if s is not None]
            axis.bar(range(len(shown)), [s.mean for _, s in shown], yerr=[s.std for _, s in shown], capsize=4,
                     color="tab:blue")
            axis.set_xticks(range(len(shown)), [label for label, _ in shown], rotation=20, ha="right", fontsize=8)
        axis.axhline(random_init, color="grey", linestyle="--", linewidth=1)  # points, like the bars
        axis.set_title(f"{ablation.name}: {ablation.source}", fontsize=9)
        axis.set_ylabel("kNN %")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def write(sweep: Sweep, markdown: Path) -> tuple[Path, Path]:
    """Write the document and its PNG (same name, .png) atomically; returns both paths."""
    png = plot(sweep, markdown.with_suffix(".png"))
    temporary = markdown.with_suffix(".md.tmp")
    temporary.write_text(render(sweep, png.name), encoding="utf-8")  # it holds "±" whatever the locale
    temporary.replace(markdown)
    return markdown, png
