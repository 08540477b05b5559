"""Row-sharded state that reloads on any number of ranks.

In a component's ``state_dict()``, tensors wrapped in ``ShardedRows`` are rows ``[start, end)`` of
a larger tensor.  ``encode_state`` turns such a state into plain dicts that weights-only loading
accepts, each row kept once (by its ``primary`` holder); ``decode_state`` fills a live state with
the rows it asks for from whichever saved states hold them, so a state written by T ranks loads
on any T'.  Other values come from one saved state (the caller picks this rank's, or rank 0's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_ROWS_TAG = "__sharded_rows__"


@dataclass
class ShardedRows:
    """Rows ``[start, end)`` of a ``total``-row tensor held by this rank (``rows`` may be None while
    the state does not exist yet).  ``primary`` is False on ranks whose rows duplicate another
    rank's (replicas), so each row is written once."""

    rows: torch.Tensor | None
    start: int
    end: int
    total: int
    primary: bool = True


def encode_state(value):
    """``value`` with every ``ShardedRows`` a plain dict and every tensor on the CPU."""
    if isinstance(value, ShardedRows):
        rows = value.rows.detach().cpu() if value.rows is not None and value.primary else None
        return {_ROWS_TAG: True, "start": value.start, "end": value.end, "total": value.total,
                "present": value.rows is not None, "rows": rows}
    if isinstance(value, dict):
        return {key: encode_state(item) for key, item in value.items()}
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    return value


def _is_rows(value) -> bool:
    return isinstance(value, dict) and value.get(_ROWS_TAG) is True


def decode_state(template, saved_states: list[dict], own: dict, path: str, device: torch.device):
    """The live ``template`` filled from every rank's saved state (``own``: the one that plain
    values come from).  ``path`` names the value in errors ("" at the root)."""
    if isinstance(template, ShardedRows):
        return ShardedRows(assemble_rows(template, saved_states, path, device), template.start, template.end,
                           template.total, template.primary)
    if isinstance(template, dict):
        if not isinstance(own, dict):
            raise ValueError(f"checkpoint state {path or 'root'} is not a mapping; was it written by another version?")
        missing = [key for key in template if key not in own]
        if missing:
            raise ValueError(f"checkpoint state {path or 'root'} lacks {missing}; was it written by another objective?")
        return {key: decode_state(template[key], [s[key] for s in saved_states], own[key], _join(path, key), device)
                for key in template}
    return own


def assemble_rows(template: ShardedRows, saved: list[dict], path: str, device: torch.device):
    """Rows ``[template.start, template.end)`` from whichever saved pieces cover them (None if the
    state did not exist when the checkpoint was written)."""
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
            _missing_rows(path, covered, min(piece["start"], template.end))
        if covered < hi:
            pieces.append(piece["rows"][covered - piece["start"] : hi - piece["start"]])
            covered = hi
    if covered < template.end:
        _missing_rows(path, covered, template.end)
    # One piece stays a view of the memory-mapped file (a disk row store copies it block by block),
    # and rows go where the live component keeps them: a host/disk store's never pass the GPU.
    if template.rows is not None:
        device = template.rows.device
    return (pieces[0] if len(pieces) == 1 else torch.cat(pieces)).to(device)


def _missing_rows(path: str, start: int, end: int):
    raise ValueError(f"checkpoint state {path}: rows [{start}, {end}) are in no saved file; the checkpoint is "
                     "incomplete (a rank's file is missing?): resume from an earlier one")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key
