"""`instcls bench eval`: what the end-of-run evaluation costs on this machine, in one process.

1. Feature extraction: the job's backbone (``--config``, at random init) over the scikit-learn digits as a
   labelled bank and held-out set (written to a temporary folder), through the job's loader: images/s.
2. The linear probe on those features, the data-parallel SGD probe (its sweep) beside scikit-learn's
   fit, the reference: seconds and top-1 of each, side by side.
3. SGD probe epochs on synthetic features of ImageNet-1K's width and classes (2048, 1000), at the
   per-rank batch of 64 ranks: rows per second, and what an epoch of one rank's share of ImageNet-1K
   on 64 ranks (20,019 rows) takes at that rate (docs/benchmarks.md).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from trainer.bench.settings.evaluation import EvalBenchSettings
from trainer.evaluation.features import LocalFeatures

IN1K_SHARE = -(-1_281_167 // 64)  # rows per rank of ImageNet-1K's training set on 64 ranks


def _digits(root: Path) -> dict[str, Path]:
    from data_pipeline.ingest.make_shards import ShardSettings, write_shards
    from data_pipeline.ingest.sources.generated import sklearn_digits

    for split in ("train", "val"):
        write_shards(sklearn_digits(32, split=split), root / split, ShardSettings(prefix=split, samples_per_shard=256),
                     progress=False)
    return {split: root / split for split in ("train", "val")}


def _timed(work):
    started = time.perf_counter()
    result = work()
    return result, time.perf_counter() - started


def run(settings: EvalBenchSettings) -> dict:
    from trainer.checkpoint.initial_weights import starting_network
    from trainer.config import load_job_config
    from trainer.evaluation.features import EvaluationData
    from trainer.evaluation.linear import linear_probe_accuracy
    from trainer.evaluation.linear_protocol import probe_grid
    from trainer.evaluation.linear_sgd import ProbeGrid, linear_probe
    from trainer.parallel.dims import single_process_dims

    dims = single_process_dims(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    with tempfile.TemporaryDirectory(prefix="instcls-bench-eval-") as folder:
        shards = _digits(Path(folder))
        config = load_job_config(settings.config, [f"data.train_shards={shards['train']}",
                                                   f"data.eval_shards={shards['val']}", "data.knn_bank_shards=null"])
        model = starting_network(config).to(dims.device)
        data = EvaluationData(config.data, config.eval, dims)
        (bank, queries), extract_s = _timed(lambda: data.bank_and_queries(model))
    grid = probe_grid(config.eval.linear)
    sgd, sgd_s = _timed(lambda: linear_probe(bank, queries, grid, None)[1.0])
    reference, sklearn_s = _timed(lambda: linear_probe_accuracy(bank.features.cpu(), bank.labels.cpu(),
                                                                queries.features.cpu(), queries.labels.cpu()))
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, settings.classes, (settings.rows,), generator=generator)
    synthetic = LocalFeatures(torch.randn(settings.rows, settings.width, generator=generator).to(dims.device),
                              labels.to(dims.device), torch.arange(settings.rows, device=dims.device))
    one_rank = ProbeGrid(grid.learning_rates, grid.weight_decays, settings.epochs, grid.batch_size // 64 or 1,
                         grid.momentum, grid.held_out, grid.seed)
    _, epochs_s = _timed(lambda: linear_probe(synthetic, LocalFeatures(synthetic.features[:1], labels[:1].to(
        dims.device), synthetic.ids[:1]), one_rank, None))
    images = bank.ids.numel() + queries.ids.numel()
    return {"device": str(dims.device), "arch": config.model.arch, "images": images, "extract_seconds": extract_s,
            "images_per_second": images / extract_s, "bank": list(bank.features.shape), "heads": len(grid.heads),
            "epochs": grid.epochs, "sgd_seconds": sgd_s, "sgd_top1": sgd.top1, "sklearn_seconds": sklearn_s,
            "sklearn_top1": reference, "synthetic": [settings.rows, settings.width, settings.classes],
            "synthetic_batch": one_rank.batch_size, "synthetic_seconds_per_epoch": epochs_s / settings.epochs,
            "synthetic_rows_per_second": settings.rows * settings.epochs / epochs_s}


def format_report(summary: dict) -> str:
    rows, width, classes = summary["synthetic"]
    return "\n".join([
        f"instcls bench eval, one process on {summary['device']}",
        f"feature extraction ({summary['arch']} at random init, the digits): {summary['images']:,} images in "
        f"{summary['extract_seconds']:.2f} s = {summary['images_per_second']:,.0f} images/s",
        f"linear probe on those features ({summary['bank'][0]:,} x {summary['bank'][1]}):",
        f"  sgd ({summary['heads']} heads, {summary['epochs']} epochs): {summary['sgd_seconds']:.2f} s, top-1 "
        f"{100 * summary['sgd_top1']:.2f}%",
        f"  sklearn (the reference):      {summary['sklearn_seconds']:.2f} s, top-1 "
        f"{100 * summary['sklearn_top1']:.2f}%  (sgd / sklearn time: "
        f"{summary['sgd_seconds'] / summary['sklearn_seconds']:.2f})",
        f"sgd probe epoch on {rows:,} rows x {width}, {classes:,} classes, {summary['heads']} heads, "
        f"{summary['synthetic_batch']} rows a step: {summary['synthetic_seconds_per_epoch']:.2f} s = "
        f"{summary['synthetic_rows_per_second']:,.0f} rows/s; one rank's share of ImageNet-1K on 64 ranks "
        f"(20,019 rows) at that rate: {IN1K_SHARE / summary['synthetic_rows_per_second']:,.0f} s an epoch",
    ])
