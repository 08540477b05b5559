"""Row-sharded checkpoint state put back together for another layout: rows go through DCP as
chunks of one global tensor (``engine.row_checkpoint``); older checkpoints hold them inline
(``parallel.sharded_state.assemble_rows``).  One process writes several ranks' chunks here by
giving one tensor several shards, as DCP allows."""

import pickle

import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from trainer.checkpoint.components import load_component
from trainer.checkpoint.row_checkpoint import (
    check_covered,
    load_rows,
    read_full_rows,
    read_metadata,
    save_rows,
    target_rows,
)
from trainer.checkpoint.safe_load import UnsafeCheckpointError
from trainer.drills.catalogue import TouchesAFile
from trainer.objectives import ShardedRows
from trainer.parallel import single_process_dims

TOTAL = 10
FULL = torch.arange(TOTAL * 2, dtype=torch.float32).view(TOTAL, 2)
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _save(folder, *ranges):
    """The rows of ``ranges`` (one per writing rank) as one DCP checkpoint."""
    local = torch.cat([FULL[a:b] for a, b in ranges])
    local.global_shape = tuple(FULL.shape)
    local.global_offsets = tuple((a, 0) for a, _ in ranges)
    local.local_offsets, at = [], 0
    for a, b in ranges:
        local.local_offsets.append((at, 0))
        at += b - a
    local.local_offsets = tuple(local.local_offsets)
    local.local_sizes = tuple((b - a, 2) for a, b in ranges)
    return save_rows(folder, {"weight": local}, None)


@pytest.mark.parametrize("start,end", [(0, 10), (2, 7), (3, 4), (6, 10)])
def test_any_range_is_read_from_the_chunks_that_cover_it(tmp_path, start, end):
    written = _save(tmp_path, (0, 4), (4, 6), (6, 10))
    assert sorted(written) == [".metadata", "__0_0.distcp"]
    metadata = read_metadata(tmp_path)
    check_covered(metadata, "weight", start, end, "weight")
    target = target_rows(metadata, "weight", None, start, end, torch.device("cpu"))
    load_rows(tmp_path, metadata, {"weight": (target, start)}, None)
    assert torch.equal(target, FULL[start:end])


def test_rows_are_read_into_the_live_tensor_when_it_has_their_shape(tmp_path):
    _save(tmp_path, (0, 10))
    metadata = read_metadata(tmp_path)
    live = torch.zeros(3, 2)
    assert target_rows(metadata, "weight", live, 2, 5, torch.device("cpu")) is live
    assert target_rows(metadata, "weight", torch.zeros(4, 2), 2, 5, torch.device("cpu")) is not live
    load_rows(tmp_path, metadata, {"weight": (live, 2)}, None)
    assert torch.equal(live, FULL[2:5])


def test_a_gap_is_reported_by_name(tmp_path):
    _save(tmp_path, (0, 4), (6, 10))
    with pytest.raises(ValueError, match=r"weight: rows \[4, 6\) are in no saved file"):
        check_covered(read_metadata(tmp_path), "weight", 0, TOTAL, "weight")
    with pytest.raises(ValueError, match=r"rows \[4, 6\)"):
        read_full_rows(tmp_path)


class _Table:
    """A component with one row-sharded tensor and one plain value."""

    def __init__(self, rows, total=TOTAL):
        self.rows, self.total, self.count = rows, total, 0

    def state_dict(self):
        return {"rows": ShardedRows(self.rows, 0, self.total, self.total), "count": self.count}

    def load_state_dict(self, state):
        self.rows, self.count = state["rows"].rows, state["count"]


def test_a_wrong_size_or_missing_rows_are_reported_by_name(tmp_path):
    folder = tmp_path / "components" / "table"
    folder.mkdir(parents=True)
    torch.save({"rows": {"__sharded_rows__": True, "key": "rows", "start": 0, "end": 10, "total": 10, "present": True},
                "count": 3}, folder / "rank-00000.pt")
    with pytest.raises(ValueError, match=r"lacks the rows of rows; it is incomplete"):
        load_component(tmp_path, "table", _Table(None), single_process_dims(), torch.device("cpu"))
    _save(folder / "rows", (0, 10))
    with pytest.raises(ValueError, match="has 10 rows but this run needs 12"):
        load_component(tmp_path, "table", _Table(None, total=12), single_process_dims(), torch.device("cpu"))


def test_checkpoints_with_inline_rows_still_load(tmp_path):
    """The format before DCP: each rank's file held its rows; replicas wrote none."""
    folder = tmp_path / "components" / "table"
    folder.mkdir(parents=True)
    for rank, (start, end, rows) in enumerate([(0, 6, FULL[:6]), (6, 10, FULL[6:]), (0, 10, None)]):
        node = {"__sharded_rows__": True, "start": start, "end": end, "total": TOTAL, "present": True, "rows": rows}
        torch.save({"rows": node, "count": 7}, folder / f"rank-{rank:05d}.pt")
    table = _Table(None)
    load_component(tmp_path, "table", table, single_process_dims(), torch.device("cpu"))
    assert torch.equal(table.rows, FULL) and table.count == 7


def test_state_that_did_not_exist_stays_absent(tmp_path):
    folder = tmp_path / "components" / "table"
    folder.mkdir(parents=True)
    torch.save({"rows": {"__sharded_rows__": True, "key": "rows", "start": 0, "end": 10, "total": 10,
                         "present": False}, "count": 1}, folder / "rank-00000.pt")
    table = _Table(torch.ones(TOTAL, 2))
    load_component(tmp_path, "table", table, single_process_dims(), torch.device("cpu"))
    assert table.rows is None and table.count == 1


def test_tampered_metadata_is_refused_before_anything_runs(tmp_path):
    _save(tmp_path, (0, 10))
    marker = tmp_path / "ran"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(TouchesAFile(marker)))
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: refusing to load it: .*pathlib.Path.touch"):
        read_metadata(tmp_path)
    assert not marker.exists()


def test_metadata_naming_an_object_entry_is_refused(tmp_path):
    """DCP would unpickle such an entry's bytes with weights_only=False."""
    _save(tmp_path, (0, 10))
    metadata = read_metadata(tmp_path)
    metadata.state_dict_metadata["weight"] = BytesStorageMetadata()
    (tmp_path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeCheckpointError, match="refusing to load it: .*BytesStorageMetadata"):
        read_metadata(tmp_path)


class _EnumsByName(pickle.Pickler):
    """Pickles enum members as ``getattr(EnumClass, "NAME")``, as Python 3.11.2 does."""

    def reducer_override(self, obj):
        import enum
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def _pickle_enums_by_name(obj) -> bytes:
    import io
    buffer = io.BytesIO()
    _EnumsByName(buffer).dump(obj)
    return buffer.getvalue()


def test_metadata_pickled_with_enums_by_name_loads(tmp_path):
    """A checkpoint written under another Python release (enum members pickled through getattr)
    resumes: the same rows come back."""
    _save(tmp_path, (0, 4), (4, 10))
    original = read_metadata(tmp_path)
    by_name = _pickle_enums_by_name(original)
    assert b"getattr" in by_name
    (tmp_path / ".metadata").write_bytes(by_name)
    metadata = read_metadata(tmp_path)
    assert metadata.state_dict_metadata == original.state_dict_metadata
    assert torch.equal(read_full_rows(tmp_path)["weight"], FULL)


def test_getattr_in_metadata_reaches_enum_members_only(tmp_path):
    """getattr is admitted for members of enums, never for other attributes."""
    import pathlib
    _save(tmp_path, (0, 10))

    class _GetsAMethod:
        def __reduce__(self):
            return getattr, (pathlib.PosixPath, "touch")

    (tmp_path / ".metadata").write_bytes(pickle.dumps(_GetsAMethod()))
    with pytest.raises(UnsafeCheckpointError, match=r"refusing to load it: Unsupported call: getattr\('PosixPath', "
                                                    r"'touch'\)"):
        read_metadata(tmp_path)
