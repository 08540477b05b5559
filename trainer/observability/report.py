"""A run at a glance, from its JSONL logs: the summary table the demo prints and a PNG of loss,
kNN accuracy per epoch, the linear probe's learning curve, throughput and memory per rank.

Everything is read back from ``logging.dir`` (one ``rank-NNNNN.jsonl`` per rank), so a report can
be made of any run, finished or not, on any machine, after the fact.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

MIB = 1 << 20


@dataclass
class RunLogs:
    """The records of one run, by rank."""

    by_rank: dict[int, list[dict]]

    @classmethod
    def read(cls, directory: Path) -> "RunLogs":
        files = sorted(Path(directory).glob("rank-*.jsonl"))
        if not files:
            raise FileNotFoundError(f"{directory}: no rank-*.jsonl log files; pass the run's logging.dir")
        by_rank = {}
        for path in files:
            lines = path.read_text().splitlines()
            by_rank[int(path.stem.removeprefix("rank-"))] = [json.loads(line) for line in lines if line.strip()]
        return cls(by_rank)

    def events(self, kind: str, rank: int = 0) -> list[dict]:
        return [r for r in self.by_rank.get(rank, []) if r.get("event") == kind]

    def last(self, kind: str, rank: int = 0) -> dict | None:
        found = self.events(kind, rank)
        return found[-1] if found else None

    def summaries(self) -> list[dict]:
        """Each rank's end-of-run summary, by rank (none before the run finished)."""
        return [s for rank in sorted(self.by_rank) if (s := self.last("summary", rank))]

    def images_per_second(self) -> float:
        """Training throughput of all ranks together, from their summaries."""
        return sum(s["images"] / s["seconds"] for s in self.summaries() if s["seconds"] > 0)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def _curve_text(curve: dict[str, float] | None) -> str:
    """{"0.1": 0.4, "1.0": 0.67} -> "10%: 40.00%, 100%: 67.00%" (labels used: accuracy)."""
    if not curve:
        return "-"
    return ", ".join(f"{100 * float(fraction):g}%: {_percent(accuracy)}" for fraction, accuracy in curve.items())


def summary_rows(logs: RunLogs) -> list[tuple[str, str]]:
    """(field, value) rows: objective, epochs, kNN trained / random init, linear probe and its
    learning curve, images/s (all ranks together) and peak memory per rank."""
    summaries = logs.summaries()
    if not summaries:
        raise ValueError("the logs hold no run summary: the run has not finished (a summary is written at its end)")
    final = logs.last("eval") or {}
    peaks = ", ".join(f"{s['peak_memory_bytes'] / MIB:,.0f}" for s in summaries)
    kind = "CUDA max allocated" if summaries[0]["peak_memory_kind"].startswith("cuda") else "RSS"
    start = "start (model.init_from)" if final.get("baseline") == "init_from" else "random init"
    return [
        ("objective", summaries[0]["objective"]),
        ("epochs", str(summaries[0]["epochs"])),
        ("kNN, trained", _percent(final.get("knn_trained"))),
        (f"kNN, {start}", _percent(final.get("knn_random_init"))),
        ("linear probe, trained", _percent(final.get("linear_trained"))),
        (f"linear probe, {start}", _percent(final.get("linear_random_init"))),
        ("linear probe by share of labels", _curve_text(final.get("linear_curve"))),
        ("images/s (all ranks)", f"{logs.images_per_second():,.1f}"),
        (f"peak memory per rank, MiB ({kind})", peaks),
    ]


def summary_table(logs: RunLogs) -> str:
    """The summary as a Markdown table (readable in a terminal, pasteable into docs)."""
    rows = summary_rows(logs)
    width = max(len(field) for field, _ in rows)
    lines = [f"| {'':<{width}} | value |", f"|{'-' * (width + 2)}|-------|"]
    lines += [f"| {field:<{width}} | {value} |" for field, value in rows]
    return "\n".join(lines)


def _memory_bytes(step: dict) -> int:
    readings = step["memory_bytes"]
    return readings["rss"] if "rss" in readings else readings["cuda_allocated"]


def _plot_probe_curve(axis, final: dict | None) -> None:
    """The linear probe's held-out accuracy against the share of labels it was fitted on, with the
    random init's all-labels probe for scale."""
    curve = (final or {}).get("linear_curve")
    if curve:
        axis.plot([100 * float(f) for f in curve], [100 * a for a in curve.values()], marker="o", label="trained")
        axis.axhline(100 * final["linear_random_init"], linestyle="--", color="tab:orange",
                     label="random init, all labels")
        axis.legend()
    axis.set(title="linear probe, held-out split", xlabel="% of training labels", ylabel="%")


def plot_run(logs: RunLogs, path: Path) -> Path:
    """Five panels: loss per step, kNN per epoch (trained and random init), the linear probe's
    learning curve, images/s per log window and memory per rank."""
    import matplotlib

    matplotlib.use("Agg")  # no display in a container
    import matplotlib.pyplot as plt

    figure, ((loss_axis, knn_axis, probe_axis), (speed_axis, memory_axis, unused)) = plt.subplots(
        2, 3, figsize=(15, 7))
    unused.set_visible(False)
    steps = logs.events("step")
    loss_axis.plot([r["step"] for r in steps], [r["loss"] for r in steps], color="tab:blue")
    loss_axis.set(title="training loss (rank 0)", xlabel="step", ylabel="loss")

    evals = logs.events("eval")
    if evals:
        epochs = [r["epoch"] for r in evals]
        knn_axis.plot(epochs, [100 * r["knn_trained"] for r in evals], marker="o", label="trained")
        knn_axis.plot(epochs, [100 * r["knn_random_init"] for r in evals], linestyle="--", label="random init")
        knn_axis.legend()
    knn_axis.set(title="kNN accuracy, held-out split", xlabel="epoch", ylabel="%")
    _plot_probe_curve(probe_axis, logs.last("eval"))

    for rank in sorted(logs.by_rank):
        rank_steps = logs.events("step", rank)
        xs = [r["step"] for r in rank_steps]
        speed_axis.plot(xs, [r["images_per_s"] for r in rank_steps], label=f"rank {rank}")
        memory_axis.plot(xs, [_memory_bytes(r) / MIB for r in rank_steps], label=f"rank {rank}")
    speed_axis.set(title="throughput per rank", xlabel="step", ylabel="images/s")
    memory_axis.set(title="memory per rank (CPU RSS or CUDA allocated)", xlabel="step", ylabel="MiB")
    for axis in (speed_axis, memory_axis):
        axis.legend()
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
