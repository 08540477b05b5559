"""The data-parallel linear probe on 1, 2 and 3 gloo ranks (one launch of 3 ranks, with groups of the
first 1, 2 and 3): the same bank and seed give the same accuracies, choices and label-fraction
curve whatever the number of ranks and however unevenly the rows lie; its collectives are
all-reduces of counts, statistics and the heads' gradient, never a gather of features."""

import json

import pytest
import torch
import torch.distributed as dist

from trainer.dry_run.collectives import CollectiveRecorder
from trainer.evaluation.features import LocalFeatures
from trainer.evaluation.linear_sgd import ProbeGrid, linear_probe
from trainer.parallel import init_distributed
from trainer.parallel.launch import spawn_local_workers

pytestmark = pytest.mark.integration

ROWS, QUERIES, WIDTH, CLASSES = 900, 300, 16, 7
GRID = ProbeGrid(learning_rates=(0.03, 0.3), weight_decays=(0.0, 1e-3), epochs=4, batch_size=128, momentum=0.9,
                 held_out=0.15, seed=3)
FRACTIONS = (0.25, 1.0)


def _data(rows, seed):
    centres = 1.5 * torch.randn(CLASSES, WIDTH, generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, CLASSES, (rows,), generator=generator)
    return centres[labels] + torch.randn(rows, WIDTH, generator=generator), labels


def _share(features, labels, rank, size, uneven):
    """Strided rows, or (uneven) contiguous pieces of very different sizes."""
    rows = len(labels)
    if uneven and size > 1:
        cuts = torch.tensor([0, rows // 7, rows // 2, rows][: size] + [rows])
        mine = torch.arange(int(cuts[rank]), int(cuts[rank + 1]))
    else:
        mine = torch.arange(rank, rows, size)
    return LocalFeatures(features[mine], labels[mine], mine * 5 + 11)


def _probe_in_groups(out):
    dims = init_distributed()
    groups = {size: dist.new_group(list(range(size))) for size in (1, 2, 3)}  # every rank creates every group
    bank, queries = _data(ROWS, 1), _data(QUERIES, 2)
    found = {}
    for size in (1, 2, 3):
        for uneven in (False, True):
            if dims.rank >= size:
                continue
            recorder = CollectiveRecorder()
            with recorder:
                mine = _share(*bank, dims.rank, size, uneven), _share(*queries, dims.rank, size, uneven)
                results = linear_probe(*mine, GRID, groups[size], FRACTIONS)
            ops = {(c.op, c.tensors) for c in recorder.collectives}
            found[f"{size}-{uneven}"] = {"results": {str(f): r.record() for f, r in results.items()},
                                         "ops": sorted(map(list, ops))}
    (out / f"rank-{dims.rank}.json").write_text(json.dumps(found))
    dist.barrier()


def test_one_two_and_three_ranks_give_the_same_probe(tmp_path):
    spawn_local_workers(_probe_in_groups, 3, tmp_path)
    found = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(3)]
    reference = found[0]["1-False"]["results"]
    assert reference["1.0"]["top1"] > 0.8, reference  # the blobs are separable: the probe learned
    for case in ("1-True", "2-False", "2-True", "3-False", "3-True"):
        size = int(case[0])
        for rank in range(size):
            results = found[rank][case]["results"]
            for fraction, expected in reference.items():
                got = results[fraction]
                for key in ("top1", "top5", "held_out_top1"):
                    assert abs(got[key] - expected[key]) <= 1e-6, (case, rank, fraction, key, got, expected)
                assert (got["learning_rate"], got["weight_decay"]) == (expected["learning_rate"],
                                                                        expected["weight_decay"]), (case, got)
    for case, entry in found[0].items():
        assert entry["ops"] and all(op.startswith("allreduce") for op, _ in entry["ops"]), entry["ops"]
        gathered = [shapes for op, shapes in entry["ops"] if any(f", {WIDTH}]" in s for s in shapes)]
        assert not gathered, (case, gathered)  # no [rows, features] tensor crosses ranks
