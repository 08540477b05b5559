import pytest
import torch

from trainer.classifier import ClassShard, all_shards, gaussian_rows


@pytest.mark.parametrize("num_classes,num_shards", [(10, 1), (10, 3), (37, 4), (1_000_003, 7), (5, 5)])
def test_shards_are_contiguous_and_sized_like_the_formula(num_classes, num_shards):
    shards = all_shards(num_classes, num_shards)
    expected_start = 0
    for index, shard in enumerate(shards):
        assert shard.num_classes_local == num_classes // num_shards + (index < num_classes % num_shards)
        assert shard.class_start == expected_start
        expected_start = shard.class_end
    assert expected_start == num_classes


@pytest.mark.parametrize("num_classes,num_shards", [(10, 3), (37, 4), (64, 8), (101, 2)])
def test_owner_of_inverts_the_ranges(num_classes, num_shards):
    shards = all_shards(num_classes, num_shards)
    ids = torch.arange(num_classes)
    owner = shards[0].owner_of(ids)
    for class_id in range(num_classes):
        shard = shards[int(owner[class_id])]
        assert shard.class_start <= class_id < shard.class_end
        assert bool(shard.is_local(ids[class_id]))
        assert sum(bool(s.is_local(ids[class_id])) for s in shards) == 1


def test_more_shards_than_classes_is_refused_with_a_fix():
    with pytest.raises(ValueError, match="classifier_parallel_size"):
        ClassShard(num_classes=3, num_shards=4, shard_index=0)


def test_initial_rows_do_not_depend_on_sharding():
    num_classes, dim = 150_000, 4  # spans several init blocks
    full = gaussian_rows(0, num_classes, dim, std=1.0, seed=3)
    for shard in all_shards(num_classes, 3):
        part = gaussian_rows(shard.class_start, shard.num_classes_local, dim, std=1.0, seed=3)
        assert torch.equal(part, full[shard.class_start : shard.class_end])
    assert not torch.equal(full, gaussian_rows(0, num_classes, dim, std=1.0, seed=4))
    assert abs(full.std().item() - 1.0) < 0.01
