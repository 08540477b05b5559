"""The linear probe at scale (``eval.linear.method: sgd``): linear classifiers trained data parallel,
on every rank's own rows of the cached frozen features, with nothing gathered.

The protocol is the papers' (a linear layer on frozen backbone features, scored top-1 on the held-out
set), on features extracted once without augmentation (the inference loader's resize and centre crop)
and cached: a grid of heads, one per (learning rate, weight decay), is trained in one pass over the
cached features, each head is scored on a held-out part of the bank, and the best one is scored on
``data.eval_shards``.  That is not dinov2's linear evaluation: dinov2 also trains a grid of heads side
by side, but on features the frozen backbone computes at every step from augmented crops (random
resized crop and horizontal flip), keeping resize and centre crop for the images it scores; here each
head sees one view of each image, without the augmentation's regularisation.

What makes it the same on any number of ranks: every choice is a pure function of a sample's id
(``keyed_hash``): which bank rows are held out, which mini-batch of an epoch a row falls in, which rows
a label fraction keeps.  So global batch k holds the same samples whether they sit on 1 or 64 ranks;
each rank adds the gradient of its rows of it, and one all-reduce of every head's gradient makes the
global batch's.  Only the order of that sum depends on the ranks (float rounding, ~1e-7 relative).

Per rank the memory is its rows of the bank and of the queries, the heads' state and, for a moment,
the largest of: a mini-batch's standardised rows with its logits, a block of scored rows with its
logits, or the SGD update's one product.  The heads' state is 5 vectors of heads x classes x
(features + 1) float32: weights with biases, momentum, the gradient, and each element's weight decay
and learning rate (``linear_probe_bytes``); one grid at a time, over the label fractions.  The
features are standardised with the global mean and variance (one all-reduce of sums and squares,
accumulated in float64), batch by batch, never as a copy of the shard.  Host reads: one per epoch
(every batch's global size) and one per scoring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from trainer.evaluation.bank_subset import keyed_unit
from trainer.parallel.collectives import Group, all_reduce_

_HELD_OUT_STREAM, _BATCH_STREAM, _FRACTION_STREAM = 1, 2, 3  # independent hash streams of one seed
_STATISTICS_BLOCK = 1024  # rows standardised, summed (in float64) or scored at a time: about one batch
# A bank smaller than MIN_BATCHES batches is cut into MIN_BATCHES smaller ones (of MIN_ROWS_PER_BATCH
# rows at least), so that a small bank still gets enough steps: 30 epochs of 1 full batch do not fit.
MIN_BATCHES, MIN_ROWS_PER_BATCH = 16, 8


@dataclass(frozen=True)
class ProbeGrid:
    """The heads trained side by side, and how: ``eval.linear``'s settings."""

    learning_rates: tuple[float, ...]
    weight_decays: tuple[float, ...]
    epochs: int
    batch_size: int  # global: rows of all ranks per step
    momentum: float
    held_out: float  # the bank's share scored to choose a head
    seed: int

    @property
    def heads(self) -> list[tuple[float, float]]:
        return [(lr, wd) for lr in self.learning_rates for wd in self.weight_decays]


@dataclass(frozen=True)
class ProbeResult:
    top1: float
    top5: float | None  # None with 5 classes or fewer
    learning_rate: float
    weight_decay: float
    held_out_top1: float  # the chosen head's accuracy on the held-out part of the bank
    grid: tuple[tuple[float, float, float], ...]  # (lr, wd, held-out top-1) of every head

    def record(self) -> dict:
        return {"top1": self.top1, "top5": self.top5, "learning_rate": self.learning_rate,
                "weight_decay": self.weight_decay, "held_out_top1": self.held_out_top1,
                "grid": [list(head) for head in self.grid]}


def linear_probe_bytes(rows: int, features: int, classes: int, heads: int, batch: int, ranks: int,
                       element_bytes: int = 4, queries: int = 0, held_out: float = 0.1) -> dict[str, int]:
    """Planned bytes per rank of the probe at its peak: its rows of the bank (``rows`` over all ranks,
    stored in ``element_bytes``), the heads' state (``_Heads``: 5 vectors of every head's weights and
    biases) and the most that one moment adds to them:

    - a step (``_fit``): the last batch's standardised rows and probabilities are held while the next
      batch is standardised (2 more rows of features) or its logits and their softmax are made (2 more
      rows of logits);
    - the SGD update (``_Heads.step``): one product the size of a state vector, beside the last batch;
    - scoring (``_correct``): a block of held-out rows or of the ``queries`` (all heads), standardised
      (2 rows of features at once), then its logits and their sum with the biases.

    A hash of each row's id picks its batch and whether it is held out, so a rank's rows in a batch, and
    its held-out rows, are counted as their mean share plus 4 times its square root: more than the
    largest of thousands of batches holds.
    """
    def most(mean: float) -> int:
        return math.ceil(mean + 4 * math.sqrt(mean))

    per_rank = math.ceil(rows / ranks)
    step_rows = most(batch / ranks)
    scored_rows = min(_STATISTICS_BLOCK, max(most(rows * held_out / ranks), math.ceil(queries / ranks)))
    vector = heads * classes * (features + 1) * 4  # one value for every head's weights and biases
    row, logits = features * 4, heads * classes * 4  # one standardised row; one row's logits of every head
    return {"bank_rows": per_rank * (features * element_bytes + 16 + 8),  # features, label, id; the epoch's order
            "heads": 5 * vector,  # weights and biases, momentum, gradient, each element's decay and learning rate
            "transient": max(step_rows * (row + logits + 2 * max(row, logits)),
                             vector + step_rows * (row + logits),
                             scored_rows * max(2 * row, row + 2 * logits))}


def _standardiser(features: torch.Tensor, group: Group) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, std)`` of every rank's features together: one all-reduce of float64 sums and squares
    (and the row count), accumulated block by block."""
    width = features.shape[1]
    sums = torch.zeros(2, width + 1, dtype=torch.float64, device=features.device)
    for start in range(0, features.shape[0], _STATISTICS_BLOCK):
        block = features[start:start + _STATISTICS_BLOCK].float()  # a view of a float32 bank, else one block
        sums[0, :width] += block.sum(0, dtype=torch.float64)
        sums[1, :width] += block.square().sum(0, dtype=torch.float64)
    sums[0, width] = features.shape[0]
    all_reduce_(sums, dist.ReduceOp.SUM, group)
    rows = sums[0, width].clamp_min(1)  # stays on the device: no host read
    mean = sums[0, :width] / rows
    variance = (sums[1, :width] / rows - mean * mean).clamp_min(0)
    return mean.float(), variance.sqrt().clamp_min(1e-6).float()


def _class_count(labels: torch.Tensor, group: Group) -> int:
    """Classes over every rank's labels (max + 1); refuses unlabelled rows (-1) on any rank."""
    extremes = torch.tensor([-1, 0], dtype=torch.int64, device=labels.device)
    if labels.numel():
        extremes[0] = labels.max()
        extremes[1] = -labels.min()
    largest, negated_smallest = all_reduce_(extremes, dist.ReduceOp.MAX, group).tolist()
    if negated_smallest > 0:
        raise ValueError("the linear probe needs labelled shards: the bank (data.knn_bank_shards, else "
                         "data.train_shards) has unlabelled samples; make-shards from a labelled source")
    if largest < 1:
        raise ValueError("the linear probe needs at least 2 classes in the bank; point data.knn_bank_shards at a "
                         "labelled set with several classes")
    return largest + 1


class _Heads:
    """Every head of the grid as one tensor: weights ``[G, C, F]`` and biases ``[G, C]`` with SGD
    momentum, weight decay on the weights only, and a cosine learning rate per head."""

    def __init__(self, grid: ProbeGrid, classes: int, width: int, device: torch.device) -> None:
        heads = grid.heads
        self.count, self.classes, self.width = len(heads), classes, width
        self.flat = torch.zeros(self.count * classes * (width + 1), device=device)  # weights then biases
        self.velocity = torch.zeros_like(self.flat)
        self.gradient = torch.zeros_like(self.flat)
        self.learning_rates = torch.tensor([lr for lr, _ in heads], device=device)
        decays = torch.tensor([wd for _, wd in heads], device=device)
        split = self.count * classes * width
        self.decay = torch.cat([decays.repeat_interleave(classes * width), torch.zeros(self.count * classes,
                                                                                        device=device)])
        self.weights = self.flat[:split].view(self.count, classes, width)
        self.biases = self.flat[split:].view(self.count, classes)
        self.gradient_weights = self.gradient[:split].view(self.count, classes, width)
        self.gradient_biases = self.gradient[split:].view(self.count, classes)
        self.lr_per_element = torch.cat([self.learning_rates.repeat_interleave(classes * width),
                                         self.learning_rates.repeat_interleave(classes)])

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """``[G, m, C]`` for standardised ``rows [m, F]``."""
        return torch.einsum("mf,gcf->gmc", rows, self.weights) + self.biases[:, None, :]

    def step(self, scale: float, momentum: float) -> None:
        """SGD with momentum on the all-reduced gradient, every head at its own learning rate x ``scale``."""
        self.gradient.add_(self.flat * self.decay)
        self.velocity.mul_(momentum).add_(self.gradient)
        self.flat.sub_(self.velocity * self.lr_per_element, alpha=scale)


def _batches(ids: np.ndarray, seed: int, epoch: int, batches: int) -> np.ndarray:
    """Each row's mini-batch in ``epoch``: a pure function of its id, so the same on any number of ranks."""
    return np.minimum((keyed_unit(ids, seed, _BATCH_STREAM, epoch) * batches).astype(np.int64), batches - 1)


def _fit(heads: _Heads, features, labels, ids_host: np.ndarray, positions: np.ndarray, total_rows: int,
         mean, std, grid: ProbeGrid, group: Group) -> None:
    """Train every head on the rows at ``positions`` (of this rank's ``features``; ``total_rows`` over all ranks)."""
    device = features.device
    batches = max(1, min(total_rows // MIN_ROWS_PER_BATCH, max(MIN_BATCHES, round(total_rows / grid.batch_size))))
    steps, step = grid.epochs * batches, 0
    for epoch in range(grid.epochs):
        assignment = _batches(ids_host[positions], grid.seed, epoch, batches)
        order = np.argsort(assignment, kind="stable")
        local_counts = np.bincount(assignment, minlength=batches)
        ends = np.cumsum(local_counts)
        global_counts = all_reduce_(torch.from_numpy(local_counts).to(device), dist.ReduceOp.SUM,
                                    group).tolist()  # one read an epoch
        rows_in_order = torch.from_numpy(positions[order]).to(device)
        for batch in range(batches):
            step += 1
            if global_counts[batch] == 0:
                continue
            rows = rows_in_order[(ends[batch - 1] if batch else 0):ends[batch]]
            standardised = (features[rows].float() - mean) / std
            probabilities = torch.softmax(heads.logits(standardised), dim=-1)  # [G, m, C]
            probabilities[:, torch.arange(rows.numel(), device=device), labels[rows]] -= 1
            probabilities /= global_counts[batch]  # the mean over the global batch
            torch.matmul(probabilities.transpose(1, 2), standardised, out=heads.gradient_weights)  # [G, C, F]
            torch.sum(probabilities, dim=1, out=heads.gradient_biases)
            all_reduce_(heads.gradient, dist.ReduceOp.SUM, group)
            heads.step(0.5 * (1 + math.cos(math.pi * (step - 1) / steps)), grid.momentum)


def _correct(heads: _Heads, features, labels, positions: torch.Tensor, mean, std, tops: tuple[int, ...],
             head: int | None = None) -> torch.Tensor:
    """``[heads, len(tops)]`` (one row for ``head`` alone): how many of the rows at ``positions`` have
    their label among each ``top`` best logits, from one pass, a block of rows at a time."""
    selected = slice(None) if head is None else slice(head, head + 1)
    correct = torch.zeros(heads.count if head is None else 1, len(tops), dtype=torch.int64, device=features.device)
    for start in range(0, positions.numel(), _STATISTICS_BLOCK):
        rows = positions[start:start + _STATISTICS_BLOCK]
        logits = heads.logits((features[rows].float() - mean) / std)[selected]
        best = logits.topk(min(max(tops), heads.classes), dim=-1).indices  # [g, m, top], best first
        hits = best == labels[rows, None]
        correct += torch.stack([hits[..., :top].any(-1).sum(-1) for top in tops], dim=-1)
    return correct


def linear_probe(bank, queries, grid: ProbeGrid, group: Group, fractions=(1.0,)) -> dict[float, ProbeResult]:
    """Collective: for each label fraction, the grid trained on that stratified share of the bank's
    non-held-out rows, the best head by held-out top-1 (ties: the first in grid order) and its top-1
    (and top-5) on the queries.  ``bank``/``queries``: this rank's ``LocalFeatures``."""
    features, labels = bank.features, bank.labels
    classes = _class_count(labels, group)
    mean, std = _standardiser(features, group)
    ids_host = bank.ids.cpu().numpy()
    held_out = keyed_unit(ids_host, grid.seed, _HELD_OUT_STREAM) < grid.held_out
    keep_unit = keyed_unit(ids_host, grid.seed, _FRACTION_STREAM)
    counts = torch.tensor([int(held_out.sum()), queries.labels.numel(),
                           *[int((~held_out & (keep_unit < f)).sum()) for f in fractions]], device=features.device)
    held_out_rows, query_rows, *train_rows = all_reduce_(counts, dist.ReduceOp.SUM, group).tolist()
    device = features.device
    held_out_positions = torch.from_numpy(np.flatnonzero(held_out)).to(device)
    query_features, query_labels = queries.features, queries.labels.to(device)
    every_query = torch.arange(query_labels.numel(), device=device)
    results = {}
    for fraction, total in zip(fractions, train_rows):
        heads = _Heads(grid, classes, features.shape[1], features.device)
        positions = np.flatnonzero(~held_out & (keep_unit < fraction))
        _fit(heads, features, labels, ids_host, positions, total, mean, std, grid, group)
        scores = all_reduce_(_correct(heads, features, labels, held_out_positions, mean, std, (1,))[:, 0].contiguous(),
                             dist.ReduceOp.SUM, group).tolist()
        best = max(range(heads.count), key=lambda h: (scores[h], -h))
        on_queries = _correct(heads, query_features, query_labels, every_query, mean, std,
                              (1, 5) if classes > 5 else (1,), best)[0]
        query_correct = all_reduce_(on_queries, dist.ReduceOp.SUM, group).tolist()
        (lr, wd) = grid.heads[best]
        results[fraction] = ProbeResult(
            top1=query_correct[0] / query_rows, top5=query_correct[-1] / query_rows if classes > 5 else None,
            learning_rate=lr, weight_decay=wd, held_out_top1=scores[best] / max(held_out_rows, 1),
            grid=tuple((h_lr, h_wd, s / max(held_out_rows, 1)) for (h_lr, h_wd), s in zip(grid.heads, scores)))
        del heads  # else the next fraction's grid is built while this one is still held: twice the state
    return results
