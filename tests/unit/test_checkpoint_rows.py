"""Row-sharded checkpoint state put back together for another layout (``parallel.sharded_state``)."""

import pytest
import torch

from trainer.parallel.sharded_state import assemble_rows, encode_state
from trainer.objectives import ShardedRows

TOTAL = 10
FULL = torch.arange(TOTAL * 2, dtype=torch.float32).view(TOTAL, 2)


def saved(*ranges, primary=True):
    return [encode_state(ShardedRows(FULL[a:b], a, b, TOTAL, primary)) for a, b in ranges]


@pytest.mark.parametrize("start,end", [(0, 10), (2, 7), (3, 4), (6, 10)])
def test_any_range_is_read_from_the_pieces_that_cover_it(start, end):
    pieces = saved((0, 4), (4, 6), (6, 10))
    rows = assemble_rows(ShardedRows(None, start, end, TOTAL), pieces, "weight", torch.device("cpu"))
    assert torch.equal(rows, FULL[start:end])


def test_replicas_write_nothing_and_overlaps_are_read_once():
    pieces = saved((0, 10)) + saved((0, 10), primary=False) + saved((0, 5))
    assert pieces[1]["rows"] is None and pieces[1]["present"]
    rows = assemble_rows(ShardedRows(None, 0, TOTAL, TOTAL), pieces, "weight", torch.device("cpu"))
    assert torch.equal(rows, FULL)


def test_a_gap_or_a_wrong_size_is_reported_by_name():
    with pytest.raises(ValueError, match=r"weight: rows \[4, 6\) are in no saved file"):
        assemble_rows(ShardedRows(None, 0, TOTAL, TOTAL), saved((0, 4), (6, 10)), "weight", torch.device("cpu"))
    with pytest.raises(ValueError, match="has 10 rows but this run needs 12"):
        assemble_rows(ShardedRows(None, 0, 12, 12), saved((0, 10)), "weight", torch.device("cpu"))


def test_state_that_did_not_exist_stays_absent():
    pieces = [encode_state(ShardedRows(None, 0, TOTAL, TOTAL))]
    assert assemble_rows(ShardedRows(None, 0, TOTAL, TOTAL), pieces, "momentum", torch.device("cpu")) is None
