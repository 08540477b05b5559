"""The data-parallel linear probe (``eval.linear.method: sgd``) in one process: every head of the
sweep follows the same steps as torch's own SGD on ``F.cross_entropy`` (an independent reference),
its memory stays within its rows plus one batch and its plan (``linear_probe_bytes``) holds the
measured peak within 5%, the method follows the bank's size, and ``eval.linear``'s values are checked."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker

from tests.helpers.training import REPO
from trainer.config import ConfigError, load_job_config
from trainer.eval_config import LinearProbeSection
from trainer.evaluation.features import LocalFeatures
from trainer.evaluation.linear_sgd import (
    ProbeGrid,
    _batches,
    _fit,
    _Heads,
    _standardiser,
    linear_probe,
    linear_probe_bytes,
)

CLASSES, WIDTH = 5, 12


def _blobs(rows: int, seed: int = 0, width: int = WIDTH, classes: int = CLASSES) -> LocalFeatures:
    """Gaussian blobs around the same class centres for every ``seed`` (which draws the rows)."""
    centres = 2 * torch.randn(classes, width, generator=torch.Generator().manual_seed(1234))
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (rows,), generator=generator)
    features = centres[labels] + torch.randn(rows, width, generator=generator) + 3.0  # off-centre, unscaled
    return LocalFeatures(features, labels, torch.arange(rows) * 7 + 3)  # ids need not be 0..n-1


def test_every_head_takes_the_steps_torch_sgd_takes_on_cross_entropy():
    """Two heads (learning rates 0.05 and 0.2, decays 1e-3 and 0) over 3 epochs of the id-keyed
    mini-batches: each equals an ``nn.Linear`` trained by ``torch.optim.SGD`` with momentum, the
    weight decay on the weight only, a cosine ``LambdaLR`` and ``F.cross_entropy``'s mean."""
    bank = _blobs(200)
    grid = ProbeGrid(learning_rates=(0.05, 0.2), weight_decays=(1e-3,), epochs=3, batch_size=40, momentum=0.9,
                     held_out=0.1, seed=5)
    mean, std = _standardiser(bank.features, None)
    positions = np.arange(200)
    heads = _Heads(grid, CLASSES, WIDTH, torch.device("cpu"))
    _fit(heads, bank.features, bank.labels, bank.ids.numpy(), positions, 200, mean, std, grid, None)

    batches = 16  # 200 rows at 40 a batch are 5 batches: a small bank is cut into MIN_BATCHES
    for index, lr in enumerate(grid.learning_rates):
        layer = torch.nn.Linear(WIDTH, CLASSES)
        torch.nn.init.zeros_(layer.weight)
        torch.nn.init.zeros_(layer.bias)
        optimizer = torch.optim.SGD([{"params": [layer.weight], "weight_decay": 1e-3},
                                     {"params": [layer.bias], "weight_decay": 0.0}], lr=lr, momentum=0.9)
        total = grid.epochs * batches
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s, total=total: 0.5 * (1 + math.cos(math.pi * s / total)))
        standardised = (bank.features - bank.features.mean(0)) / bank.features.std(0, unbiased=False)
        for epoch in range(grid.epochs):
            assignment = _batches(bank.ids.numpy(), grid.seed, epoch, batches)
            for batch in range(batches):
                rows = torch.from_numpy(np.flatnonzero(assignment == batch))
                if len(rows):
                    optimizer.zero_grad()
                    F.cross_entropy(layer(standardised[rows]), bank.labels[rows]).backward()
                    optimizer.step()
                schedule.step()
        torch.testing.assert_close(heads.weights[index], layer.weight.detach(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(heads.biases[index], layer.bias.detach(), rtol=1e-4, atol=1e-5)


def test_the_probe_holds_its_rows_one_batch_and_the_heads_not_a_copy_of_the_bank():
    """Tensor allocations (not RSS): what the probe allocates beside the rows it was handed keeps the
    total within 1.2 x (the rows x features x 4 B + one batch), with a grid whose heads are small
    beside the bank; a standardised copy of the bank alone would break it."""
    rows, width, batch = 8000, 256, 512
    grid = ProbeGrid(learning_rates=(0.1, 0.3), weight_decays=(0.0,), epochs=2, batch_size=batch, momentum=0.9,
                     held_out=0.1, seed=0)
    bank, queries = _blobs(rows, width=width, classes=10), _blobs(500, seed=1, width=width, classes=10)
    with MemTracker() as memory:  # it counts the tensors the probe allocates and those it reads
        linear_probe(bank, queries, grid, None, fractions=(0.5, 1.0))
    peak = memory.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    stored = (rows + 500) * (width * 4 + 16)  # features, labels, ids of the bank and the queries
    one_batch = batch * (width + 2 * 2 * 10) * 4  # its rows, standardised, and two heads' logits
    heads = 5 * 2 * 10 * (width + 1) * 4  # weights, momentum, gradient, decay, learning rate
    assert heads < 0.05 * stored
    assert rows * width * 4 <= peak <= 1.2 * (stored + one_batch), (peak, stored, one_batch)
    assert 2 * rows * width * 4 > 1.2 * (stored + one_batch)  # a copy of the bank would not fit


@pytest.mark.parametrize(("rows", "width", "classes", "heads", "batch", "held_out", "queries", "fractions"), [
    # 2 heads x 200 classes x 513 over 2 label fractions: the state is 5 of the peak's 7.1 vectors and the
    # update's product 1 more; a plan of 3 vectors, or two grids held at once, is off by a quarter or more
    pytest.param(400, 512, 200, 2, 16, 0.05, 20, (0.5, 1.0), id="heads-state"),
    # 1,200 held-out rows x 16 features: a block of 1,024 with 4 heads' logits of 500 classes, twice
    pytest.param(12000, 16, 500, 4, 512, 0.1, 50, (1.0,), id="scored-block"),
    pytest.param(8000, 256, 10, 2, 512, 0.1, 500, (0.5, 1.0), id="bank-rows"),  # the test above's shapes
])
def test_the_plan_holds_the_measured_peak_within_5_percent(rows, width, classes, heads, batch, held_out, queries,
                                                             fractions):
    """Tensor allocations (MemTracker, the bank's rows the probe reads included) against
    ``linear_probe_bytes``, where the heads' state, a scored block or the bank makes most of the
    peak: the plan is at least the peak and at most 5% above it."""
    grid = ProbeGrid(learning_rates=tuple(0.1 * (index + 1) for index in range(heads)), weight_decays=(0.0,),
                     epochs=1, batch_size=batch, momentum=0.9, held_out=held_out, seed=0)
    bank = _blobs(rows, width=width, classes=classes)
    query_set = _blobs(queries, seed=1, width=width, classes=classes)
    with MemTracker() as memory:
        linear_probe(bank, query_set, grid, None, fractions=fractions)
    peak = memory.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    planned = sum(linear_probe_bytes(rows, width, classes, heads, batch, 1, queries=queries,
                                     held_out=held_out).values())
    assert peak <= planned <= 1.05 * peak, (planned / peak, peak, planned)


def test_the_probe_separates_blobs_and_picks_by_the_held_out_rows():
    result = linear_probe(_blobs(600), _blobs(200, seed=1), ProbeGrid((0.01, 0.1), (0.0, 1e-4), 10, 64, 0.9, 0.2, 0),
                          None)[1.0]
    assert result.top1 > 0.9 and result.top5 is None  # 5 classes: a top-5 would say nothing
    assert (result.learning_rate, result.weight_decay, result.held_out_top1) in \
        {(lr, wd, score) for lr, wd, score in result.grid}
    assert result.held_out_top1 == max(score for _, _, score in result.grid)


def test_unlabelled_or_single_class_banks_are_refused():
    bank = _blobs(50)
    unlabelled = LocalFeatures(bank.features, torch.full_like(bank.labels, -1), bank.ids)
    grid = ProbeGrid((0.1,), (0.0,), 1, 16, 0.9, 0.1, 0)
    with pytest.raises(ValueError, match="needs labelled shards"):
        linear_probe(unlabelled, bank, grid, None)
    with pytest.raises(ValueError, match="at least 2 classes"):
        linear_probe(LocalFeatures(bank.features, torch.zeros_like(bank.labels), bank.ids), bank, grid, None)


def test_auto_picks_sgd_from_the_documented_bank_size_and_bad_values_are_named(tmp_path):
    section = LinearProbeSection()
    assert (section.method_for(19_999), section.method_for(20_000)) == ("sklearn", "sgd")
    assert LinearProbeSection(method="sgd").method_for(10) == "sgd"
    config = load_job_config(REPO / "configs" / "demo_cpu.yaml", [f"data.train_shards={tmp_path}"])
    assert config.eval.linear.method == "sgd", "the demo runs the path users run at scale"
    for setting, field in [("eval.linear.method=adam", "method"), ("eval.linear.learning_rates=[]", "learning_rates"),
                           ("eval.linear.held_out=1.0", "held_out"), ("eval.linear.epochs=0", "epochs"),
                           ("eval.knn_temperature=0", "knn_temperature")]:
        with pytest.raises(ConfigError, match=rf"{field}=.* is invalid"):
            load_job_config(REPO / "configs" / "demo_cpu.yaml", [f"data.train_shards={tmp_path}", setting])
