"""How a sample's instance id is stored in its tar: 8 little-endian bytes (its ``.id`` component),
read back by the sample table, the loaders and the checks, written by the shard writer."""

from __future__ import annotations

import numpy as np

ID_BYTES = 8


def encode_int64(value: int) -> bytes:
    return np.int64(value).tobytes()  # little-endian on every platform we run on


def decode_int64(raw: bytes) -> int:
    if len(raw) != ID_BYTES:
        raise ValueError(f"expected {ID_BYTES} bytes, got {len(raw)}")
    return int(np.frombuffer(raw, dtype="<i8")[0])
