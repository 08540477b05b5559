"""Row-sharded state that reloads on any number of ranks.

In a component's ``state_dict()``, tensors wrapped in ``ShardedRows`` are rows ``[start, end)`` of
a larger tensor.  ``split_state`` takes such a state apart into a plain part, which weights-only
loading accepts and in which each ``ShardedRows`` is a small placeholder naming its rows, and the
rows this rank writes (each row once, by its ``primary`` holder), which the checkpoint stores
through ``torch.distributed.checkpoint`` (``trainer.checkpoint.row_checkpoint``).  ``decode_state``
fills a live state from one saved plain part, asking a ``read_rows`` callback for the rows each
placeholder names, so a state written by T ranks loads on any T'.  Other values come from one
saved state (the caller picks this rank's, or rank 0's).

Checkpoints written before the rows moved out of the plain part hold them inline, one piece per
rank (``assemble_rows`` puts those pieces together); they still load.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

_ROWS_TAG = "__sharded_rows__"


@dataclass
class ShardedRows:
    """Rows ``[start, end)`` of a ``total``-row tensor held by this rank (``rows`` may be None while
    the state does not exist yet).  ``primary`` is False on ranks whose rows duplicate another
    rank's (replicas), so each row is written once.  ``scratch_dir``: a local directory where an
    asynchronous save copies these rows (memory-mapped) instead of into host memory, for rows that
    live in a file because they may not fit in memory (a disk row store)."""

    rows: torch.Tensor | None
    start: int
    end: int
    total: int
    primary: bool = True
    scratch_dir: Path | str | None = None


def split_state(value, path: str = "") -> tuple[object, dict[str, ShardedRows]]:
    """``(plain, rows)``: ``value`` with every ``ShardedRows`` replaced by a placeholder, and the
    ``ShardedRows`` this rank writes (present, primary, at least one row) by their path in the
    state ("weight", "queue", "recent.ids"), which names them in the checkpoint.  Tensors in the
    plain part are the live ones: the caller copies them (a snapshot) or writes them at once."""
    rows: dict[str, ShardedRows] = {}

    def walk(item, where: str):
        if isinstance(item, ShardedRows):
            if item.rows is not None and item.primary and item.end > item.start:
                rows[where] = item
            return {_ROWS_TAG: True, "key": where, "start": item.start, "end": item.end, "total": item.total,
                    "present": item.rows is not None}
        if isinstance(item, dict):
            return {key: walk(child, _join(where, key)) for key, child in item.items()}
        return item.detach() if isinstance(item, torch.Tensor) else item

    return walk(value, path), rows


def _is_rows(value) -> bool:
    return isinstance(value, dict) and value.get(_ROWS_TAG) is True


# (template, the saved placeholder, its path) -> the rows, or None when the state did not exist
RowsReader = Callable[[ShardedRows, dict, str], "torch.Tensor | None"]


def decode_state(template, own, path: str, read_rows: RowsReader):
    """The live ``template`` filled from a saved plain state ``own`` (this rank's, or rank 0's);
    rows come from ``read_rows``.  ``path`` names the value in errors ("" at the root)."""
    if isinstance(template, ShardedRows):
        if not _is_rows(own):
            raise ValueError(f"checkpoint state {path} is not row-sharded")
        if own["total"] != template.total:
            raise ValueError(f"checkpoint state {path} has {own['total']} rows but this run needs {template.total} "
                             "(a different data set?); resume with the shard set the checkpoint was trained on")
        return ShardedRows(read_rows(template, own, path), template.start, template.end, template.total,
                           template.primary, template.scratch_dir)
    if isinstance(template, dict):
        if not isinstance(own, dict):
            raise ValueError(f"checkpoint state {path or 'root'} is not a mapping; was it written by another version?")
        missing = [key for key in template if key not in own]
        if missing:
            raise ValueError(f"checkpoint state {path or 'root'} lacks {missing}; was it written by another objective?")
        return {key: decode_state(template[key], own[key], _join(path, key), read_rows) for key in template}
    return own


def names_rows(plain) -> bool:
    """Whether a plain state from ``split_state`` has row placeholders (the same on every rank: it
    follows the state's structure, not which rows a rank holds)."""
    return isinstance(plain, dict) and (_is_rows(plain) or any(map(names_rows, plain.values())))


def has_inline_rows(node: dict) -> bool:
    """A placeholder of the older format, with this rank's rows in it."""
    return "rows" in node and "key" not in node


def rows_node(state, path: str):
    """The value at ``path`` ("a.b") of a saved plain state."""
    for key in path.split(".") if path else []:
        state = state[key]
    return state


def assemble_rows(template: ShardedRows, saved: list[dict], path: str, device: torch.device):
    """Rows ``[template.start, template.end)`` from the inline pieces of an older checkpoint's rank
    files (None if the state did not exist when the checkpoint was written)."""
    if not all(_is_rows(piece) for piece in saved):
        raise ValueError(f"checkpoint state {path} is not row-sharded")
    if saved[0]["total"] != template.total:
        raise ValueError(f"checkpoint state {path} has {saved[0]['total']} rows but this run needs {template.total} "
                         "(a different data set?); resume with the shard set the checkpoint was trained on")
    if not saved[0]["present"]:
        return None
    pieces, covered = [], template.start
    for piece in sorted((p for p in saved if p["rows"] is not None), key=lambda p: p["start"]):
        if covered >= template.end:
            break
        hi = min(piece["end"], template.end)
        if piece["start"] > covered:
            missing_rows(path, covered, min(piece["start"], template.end))
        if covered < hi:
            pieces.append(piece["rows"][covered - piece["start"] : hi - piece["start"]])
            covered = hi
    if covered < template.end:
        missing_rows(path, covered, template.end)
    # One piece stays a view of the memory-mapped file (a disk row store copies it block by block),
    # and rows go where the live component keeps them: a host/disk store's never pass the GPU.
    if template.rows is not None:
        device = template.rows.device
    return (pieces[0] if len(pieces) == 1 else torch.cat(pieces)).to(device)


def missing_rows(path: str, start: int, end: int):
    raise ValueError(f"checkpoint state {path}: rows [{start}, {end}) are in no saved file; the checkpoint is "
                     "incomplete (a rank's file is missing?): resume from an earlier one")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key
