"""Row-sharded state (classifier rows, their momentum, queues) through ``torch.distributed.checkpoint``.

Each rank's rows ``[start, end)`` of a ``total``-row tensor are one chunk of a global tensor: the
plain local tensor carries DCP's ``CheckpointableTensor`` fields (global shape and offset), so the
shards may be uneven and placed anywhere, as ``num_local = N // T + (rank < N % T)`` places them.
``dcp.save`` writes one file per rank plus a ``.metadata`` naming every chunk; ``dcp.load`` reads,
for this run's rows, the overlapping parts of whichever chunks hold them: a checkpoint of T ranks
loads on any T' (DCP's resharding), and each rank reads only chunks that overlap its rows.

What DCP does not give, and is done here:

* Safety.  DCP unpickles ``.metadata`` with plain ``pickle`` and non-tensor items with
  ``weights_only=False``; a tampered checkpoint could run code.  The metadata is read with an
  unpickler that admits DCP's own metadata classes only, and every requested entry must be a
  tensor, so no item is ever unpickled as an object.
* Completeness.  DCP loads whatever overlaps and leaves rows no chunk covers untouched; missing
  rows are refused here (a rank's file lost).
* Which files a rank wrote (for its CRCs): recorded from the writer's results.
* Retries.  A rank's write of its files and the coordinator's of ``.metadata`` are each tried again
  through a transient storage error (``write_retry``): local to the rank, inside the collective
  save every rank enters once.

DCP's ``async_save`` is not used as a whole: a checkpoint here is also DeepSpeed's files, the RNG
and ``trainer.json``, committed together by one atomic rename after one manifest, so the staging
and the background thread are ``trainer.checkpoint.async_checkpoint``'s, which calls ``dcp.save`` from
its writer thread on a process group of its own.
"""

from __future__ import annotations

import enum
import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from trainer.checkpoint.safe_load import UnsafeCheckpointError
from trainer.checkpoint.save_guard import PeerSaveFailed
from trainer.checkpoint.write_retry import retry_transient
from trainer.parallel.sharded_state import missing_rows

# A single process (no job) runs DCP without collectives, as asked; DCP warns each time that it assumes so.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

ROWS_FOLDER = "rows"
METADATA_FILE = ".metadata"

# What DCP's metadata pickle may reference (checked against torch 2.14's): anything else is refused.
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata", "MetadataIndex",
        "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}


def checkpointable(rows: torch.Tensor, start: int, total: int) -> torch.Tensor:
    """``rows`` as rows ``[start, start + len(rows))`` of a ``total``-row tensor, for DCP (a new
    tensor object on the same memory: the live one is not marked)."""
    view = rows.detach().view(rows.shape)
    view.global_shape = (total, *rows.shape[1:])
    view.global_offsets = ((start,) + (0,) * (rows.dim() - 1),)
    view.local_offsets = ((0,) * rows.dim(),)
    view.local_sizes = (tuple(rows.shape),)
    return view


class _RecordingWriter(dcp.FileSystemWriter):
    """DCP's file writer, remembering the files this rank wrote (their CRCs are this rank's job)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True)
        self.written: list[str] = []

    def write_data(self, plan, planner):
        write = super().write_data
        future = retry_transient(lambda: write(plan, planner), f"writing rows into {self.path}")
        self.written += sorted({result.storage_data.relative_path for result in future.wait()})
        return future

    def finish(self, metadata, results) -> None:
        finish = super().finish
        retry_transient(lambda: finish(metadata, results), f"writing {Path(self.path) / METADATA_FILE}")
        self.written.append(METADATA_FILE)  # the coordinator's


def save_rows(folder: Path, rows: dict[str, torch.Tensor], group) -> list[str]:
    """Collective over ``group`` (None: a single process): this rank's ``checkpointable`` rows into
    ``folder``.  Returns the files this rank wrote, relative to ``folder``."""
    writer = _RecordingWriter(Path(folder))
    try:
        dcp.save(rows, storage_writer=writer, process_group=group, no_dist=group is None)
    except CheckpointException as error:  # DCP reports every rank's failure on every rank
        own = error.failures.get(dist.get_rank(group) if group is not None else 0)
        if own is not None:
            raise own[0] from None  # this rank's own (a full disk, ...): the caller names it
        first = next(iter(error.failures.values()))[0]
        raise PeerSaveFailed(f"rank(s) {sorted(error.failures)} failed to write their rows ({first})") from None
    return writer.written


def _enum_member(cls, name: str):
    """``getattr(cls, name)`` for one member of an admitted enum, nothing else.  Python 3.11.2
    (Debian bookworm's) pickles an enum member such as DCP's ``_MEM_FORMAT_ENCODING`` as
    ``getattr(EnumClass, "NAME")``, 3.11.7 as ``EnumClass(value)``: a checkpoint written under
    either must load under both (a job resumed in another image)."""
    if not (isinstance(cls, type) and issubclass(cls, enum.Enum)) or name not in cls.__members__:
        raise pickle.UnpicklingError(f"Unsupported call: getattr({getattr(cls, '__name__', cls)!r}, {name!r}) "
                                     "(only members of DCP's enums)")
    return cls.__members__[name]


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if (module, name) in _METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                      torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name}")


def read_metadata(folder: Path) -> Metadata:
    """The rows' DCP metadata, read without running pickled code; every entry must be a tensor."""
    path = Path(folder) / METADATA_FILE
    try:
        with open(path, "rb") as file:
            metadata = _MetadataUnpickler(file).load()
    except pickle.UnpicklingError as error:
        raise UnsafeCheckpointError(f"{path}: refusing to load it: {error}; it is not the metadata DCP writes, and "
                                    "unpickling other objects could run code. Resume from a checkpoint this trainer "
                                    "wrote, or delete this one to fall back to the previous.") from None
    entries = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(metadata, Metadata) or not isinstance(entries, dict) or \
            not all(isinstance(entry, TensorStorageMetadata) for entry in entries.values()):
        raise UnsafeCheckpointError(f"{path}: refusing to load it: it names entries that are not tensors, which "
                                    "DCP would unpickle as objects; this trainer writes tensors only")
    return metadata


class _SafeReader(dcp.FileSystemReader):
    def __init__(self, path: Path, metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:
        return self._metadata


def check_covered(metadata: Metadata, key: str, start: int, end: int, path: str) -> None:
    """Raise unless the saved chunks of ``key`` cover rows ``[start, end)``."""
    covered = start
    for chunk in sorted(metadata.state_dict_metadata[key].chunks, key=lambda c: c.offsets[0]):
        first, last = chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0]
        if first > covered and covered < end:
            missing_rows(path, covered, min(first, end))
        covered = max(covered, last)
    if covered < end:
        missing_rows(path, covered, end)


def target_rows(metadata: Metadata, key: str, live: torch.Tensor | None, start: int, end: int,
                device: torch.device) -> torch.Tensor:
    """Where rows ``[start, end)`` of ``key`` are read to: the live tensor when it has their shape
    (a disk row store's file is then written directly, never through anonymous memory), else a
    new one on ``device`` in the saved dtype."""
    entry = metadata.state_dict_metadata[key]
    shape = (end - start, *entry.size[1:])
    if live is not None and tuple(live.shape) == shape:
        return live
    return torch.empty(shape, dtype=entry.properties.dtype, device=device)


def load_rows(folder: Path, metadata: Metadata, targets: dict[str, tuple[torch.Tensor, int]], group) -> None:
    """Collective over ``group`` (every rank, the same keys): fill each ``(tensor, start)`` of
    ``targets`` in place with its rows of the saved tensor of that key."""
    state = {key: checkpointable(tensor, start, metadata.state_dict_metadata[key].size[0])
             for key, (tensor, start) in targets.items()}
    dcp.load(state, storage_reader=_SafeReader(Path(folder), metadata), process_group=group, no_dist=group is None)


def read_full_rows(folder: Path) -> dict[str, torch.Tensor]:
    """Every saved tensor whole, on the CPU, in this process alone (for tools and tests)."""
    metadata = read_metadata(folder)
    state = {key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
             for key, entry in metadata.state_dict_metadata.items()}
    for key in state:
        check_covered(metadata, key, 0, state[key].shape[0], key)
    dcp.load(state, storage_reader=_SafeReader(Path(folder), metadata), no_dist=True)
    return state
