"""The held-out features' digest adds up over any split of the rows, a rank with no rows included
(more ranks than held-out shards): what each rank contributes to the all-reduce."""

import torch

from trainer.evaluation.features import LocalFeatures, features_digest


def _rows(features: torch.Tensor, start: int, stop: int) -> LocalFeatures:
    ids = torch.arange(start, stop, dtype=torch.int64)
    return LocalFeatures(features[start:stop], ids % 10, ids)


def test_the_digest_of_all_rows_is_the_sum_of_every_part_even_an_empty_one():
    features = torch.randn(5, 16, generator=torch.Generator().manual_seed(0))
    whole = int(features_digest(_rows(features, 0, 5), None), 16)
    parts = [int(features_digest(_rows(features, start, stop), None), 16) for start, stop in ((0, 3), (3, 5), (5, 5))]
    assert parts[2] == 0
    assert whole == sum(parts) % 2**64
    assert whole != int(features_digest(_rows(features * 2, 0, 5), None), 16)
