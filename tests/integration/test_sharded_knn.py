"""The kNN bank and queries sharded over 2 and 3 gloo ranks against one process holding both whole:
the same k neighbours (checked against a float64 numpy reference with the documented tie rule),
the same predictions as the whole-bank topk kNN the evaluation used before, the same accuracy; no
tensor the sharded scorer allocates is taller than the rank's own queries, one round's query blocks
or one block of bank rows; the bank subset is the same everywhere."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from trainer.evaluation.bank_subset import SubsetSampler, bank_subset_ids
from trainer.evaluation.knn import knn_accuracy, sharded_knn_accuracy
from trainer.evaluation.sharded_knn import knn_bank_shard, sharded_neighbours, weighted_vote
from trainer.parallel import init_distributed
from trainer.parallel.launch import spawn_local_workers

pytestmark = pytest.mark.integration

K, TEMPERATURE, BANK_ROWS, QUERIES, DIM, CLASSES = 20, 0.07, 600, 40, 24, 7


def _gaussian_bank():
    generator = torch.Generator().manual_seed(11)
    centres = torch.randn(CLASSES, DIM, generator=generator)
    labels = torch.randint(0, CLASSES, (BANK_ROWS,), generator=generator)
    bank = centres[labels] + 1.2 * torch.randn(BANK_ROWS, DIM, generator=generator)
    query_labels = torch.randint(0, CLASSES, (QUERIES,), generator=generator)
    queries = centres[query_labels] + 1.2 * torch.randn(QUERIES, DIM, generator=generator)
    return bank, labels, queries, query_labels


def _tied_bank():
    """Rows of four ±1 entries among 8 (norm exactly 2): every cosine similarity is a multiple of
    1/4, computed exactly in any order, so many neighbours tie exactly, at the k-th place too."""
    generator = torch.Generator().manual_seed(12)

    def rows(count):
        signs = torch.randint(0, 2, (count, 4), generator=generator) * 2 - 1
        places = torch.rand(count, 8, generator=generator).argsort(dim=1)[:, :4]
        return torch.zeros(count, 8).scatter_(1, places, signs.float())

    return rows(BANK_ROWS), torch.randint(0, CLASSES, (BANK_ROWS,), generator=generator), rows(QUERIES), \
        torch.randint(0, CLASSES, (QUERIES,), generator=generator)


def _reference_neighbour_ids(bank, queries, k):
    """float64 numpy: per query, the k ids of highest cosine similarity, ties to the lower id."""
    bank = bank.double().numpy()
    queries = queries.double().numpy()
    similarities = (queries / np.linalg.norm(queries, axis=1, keepdims=True)) @ \
        (bank / np.linalg.norm(bank, axis=1, keepdims=True)).T
    ids = np.arange(bank.shape[0])
    return np.stack([np.lexsort((ids, -row))[:k] for row in similarities])


def _whole_bank_topk_predictions(bank, labels, queries, k, temperature):
    """The evaluation's kNN before sharding: one topk over the whole bank, votes scattered at once."""
    similarity, neighbour = (F.normalize(queries, dim=1) @ F.normalize(bank, dim=1).t()).topk(k, dim=1)
    votes = torch.zeros(len(queries), int(labels.max()) + 1)
    votes.scatter_add_(1, labels[neighbour], torch.exp(similarity / temperature))
    return votes.argmax(dim=1)


class _TallestTensor(TorchDispatchMode):
    """Records the largest first dimension of every tensor any operation returns."""

    def __init__(self):
        super().__init__()
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.dim():
                self.rows = max(self.rows, leaf.shape[0])
        return out


def _my_rows(rank, world, uneven):
    """Strided like the loader's stored order, or (uneven) contiguous with a last shard of fewer
    than k rows, so its candidate list is padded."""
    if not uneven:
        return torch.arange(rank, BANK_ROWS, world)
    sizes = [BANK_ROWS - 5 - (world - 2) * 100] + [100] * (world - 2) + [5]
    return torch.arange(BANK_ROWS).split(sizes)[rank]


def _my_queries(rank, world, uneven):
    """Strided, or (uneven) contiguous with the last of 3 ranks holding none: it scores only the
    others' queries, and the others run rounds past their last query."""
    if not uneven:
        return torch.arange(rank, QUERIES, world)
    return torch.arange(QUERIES).split({2: [31, 9], 3: [27, 13, 0]}[world])[rank]


def _compare_with_one_process():
    dims = init_distributed()
    rank, world, group = dims.rank, dims.world_size, dims.data_parallel_group
    query_chunk, bank_block = 16, 37
    for name, make, uneven, dtype in [("gaussian", _gaussian_bank, False, torch.float32),
                                      ("ties", _tied_bank, False, torch.float32),
                                      ("ties uneven", _tied_bank, True, torch.float32),
                                      ("gaussian float16", _gaussian_bank, True, torch.float16)]:
        bank, labels, queries, query_labels = make()
        mine, asked = _my_rows(rank, world, uneven), _my_queries(rank, world, uneven)
        label = f"{name}, rank {rank} of {world}"
        shard = knn_bank_shard(bank[mine].to(dtype), labels[mine], mine, group)
        tallest = _TallestTensor()
        with tallest:
            neighbours = sharded_neighbours(shard, queries[asked], K, group, query_chunk=query_chunk,
                                            bank_block=bank_block)
            predictions = weighted_vote(neighbours, TEMPERATURE)
        assert shard.features.shape[0] == len(mine) and shard.total_rows == BANK_ROWS, label
        # what it holds: its own queries' neighbours, one round's gathered blocks, one block of bank rows
        most = max(len(asked), world * (query_chunk // world), bank_block)
        assert tallest.rows <= most < QUERIES, f"{label}: a tensor of {tallest.rows} rows was built"

        stored = bank.to(dtype).float()  # the float16 bank's exact reference is the kNN of its rounded rows
        expected_ids = _reference_neighbour_ids(stored, queries, K)[asked.numpy()]
        assert neighbours.ids.tolist() == expected_ids.tolist(), label
        assert neighbours.labels.tolist() == labels[expected_ids].tolist(), label
        if name.startswith("gaussian"):  # no exact ties: the whole-bank topk is unambiguous
            assert predictions.tolist() == _whole_bank_topk_predictions(stored, labels, queries, K,
                                                                        TEMPERATURE)[asked].tolist(), label
        one_process = weighted_vote(sharded_neighbours(knn_bank_shard(stored, labels, torch.arange(BANK_ROWS), None),
                                                       queries, K, None), TEMPERATURE)
        assert predictions.tolist() == one_process[asked].tolist(), label

        accuracy = sharded_knn_accuracy(shard, queries[asked], query_labels[asked], K, TEMPERATURE, group)
        assert accuracy == int((one_process == query_labels).sum()) / QUERIES, label
        assert accuracy == knn_accuracy(stored, labels, queries, query_labels, K, TEMPERATURE), label


@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_knn_equals_one_process(world_size):
    spawn_local_workers(_compare_with_one_process, world_size)


def _python_smallest_hashes(num_samples, count, seed):
    """The documented choice in plain Python integers (no numpy): the ids of the smallest
    splitmix64(id + seed * 0x9E3779B97F4A7C15) values, mod 2**64."""
    mask, golden = (1 << 64) - 1, 0x9E3779B97F4A7C15

    def splitmix64(value):
        z = (value + golden) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    return sorted(sorted(range(num_samples), key=lambda i: splitmix64((i + seed * golden) & mask))[:count])


def test_bank_subset_is_fixed_nested_and_spread():
    first, again = bank_subset_ids(10_000, 1000, seed=0), bank_subset_ids(10_000, 1000, seed=0)
    assert np.array_equal(first, again) and len(np.unique(first)) == 1000 and np.all(np.diff(first) > 0)
    assert first.tolist() == _python_smallest_hashes(10_000, 1000, seed=0), "a pure function of (id, seed)"
    assert set(bank_subset_ids(10_000, 100, seed=0)) <= set(first), "a smaller subset is part of a larger one"
    assert len(set(bank_subset_ids(10_000, 1000, seed=1)) & set(first)) < 300, "another seed, another subset"
    assert np.histogram(first, bins=10, range=(0, 10_000))[0].min() > 60, "spread over the whole id range"
    assert np.array_equal(bank_subset_ids(50, 80, seed=0), np.arange(50)), "more than there are: all of them"


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_subset_sampler_reads_every_chosen_id_once(world_size):
    ids = bank_subset_ids(1000, 123, seed=4)
    sampler = SubsetSampler(ids, world_size, batch_size=8)
    read = []
    for step in range(sampler.steps_per_epoch):
        plan = sampler.step(0, step)
        read.extend(plan.ids[plan.valid].tolist())
    assert sorted(read) == ids.tolist() and len(read) == len(ids)


def _extract_shares(config_path, shards, out_dir):
    """Each rank's rows through the real loaders: the whole held-out set (the queries), then the
    bank, a subset of the training set; ids written for the parent to compare across ranks."""
    from trainer.config import load_job_config
    from trainer.evaluation.features import EvaluationData
    from trainer.models import build_model

    dims = init_distributed()
    config = load_job_config(config_path, [f"data.train_shards={shards['train']}", f"data.eval_shards={shards['val']}",
                                           "data.loader.batch_size=32", "eval.bank_samples=150",
                                           "eval.bank_subset_seed=3", "eval.bank_dtype=float16",
                                           "data.loader.num_threads=1"])
    torch.manual_seed(0)
    model = build_model(config.model)
    data = EvaluationData(config.data, config.eval, dims)
    subset, whole = data.bank_and_queries(model)
    assert subset.features.dtype == torch.float16 and whole.features.dtype == torch.float32
    torch.save({"whole": whole.ids, "whole_labels": whole.labels, "subset": subset.ids,
                "subset_rows": subset.features.shape[0], "chosen": torch.from_numpy(data.bank.sampler.ids)},
               out_dir / f"rank-{dims.rank}.pt")


def test_each_rank_keeps_only_its_share_of_the_bank(digits_split, tmp_path):
    from data_pipeline.shardset.sample_table import sample_table
    from tests.integration.conftest import REPO

    world = 2
    spawn_local_workers(_extract_shares, world, REPO / "configs/digits_cpu.yaml", digits_split, tmp_path)
    shares = [torch.load(tmp_path / f"rank-{rank}.pt") for rank in range(world)]
    held_out = sample_table(digits_split["val"]).num_samples
    steps = -(-held_out // (world * 32))
    for share in shares:  # about N/T rows: at most one batch more, never the padding repeats
        assert len(share["whole"]) <= steps * 32 and len(share["whole"]) < held_out
        assert torch.all(share["whole"][1:] > share["whole"][:-1]) and torch.all(share["whole_labels"] >= 0)
    assert sorted(torch.cat([s["whole"] for s in shares]).tolist()) == list(range(held_out)), "each id once"

    chosen = bank_subset_ids(sample_table(digits_split["train"]).num_samples, 150, seed=3)
    assert all(s["chosen"].tolist() == chosen.tolist() for s in shares), "every rank reads the same subset"
    assert sorted(torch.cat([s["subset"] for s in shares]).tolist()) == chosen.tolist()
    assert all(s["subset_rows"] == len(s["subset"]) <= 96 for s in shares)  # 150 over 2 ranks of 32-row steps


@pytest.mark.parametrize("field, value", [("bank_dtype", "bfloat16"), ("bank_samples", 0), ("bank_subset_seed", -1)])
def test_bank_settings_are_checked_naming_the_field(field, value):
    from trainer.config import ConfigError, EvalSection

    with pytest.raises(ConfigError, match=f"eval.{field}={value!r}"):
        EvalSection(**{field: value})
