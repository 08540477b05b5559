"""How a WebDataset sample's image and label are found: the image is its first component with an
image extension in the preferred order; the label is its ``.cls`` component, as WebDataset's
usual ASCII integer (``b"3"``) or as the 8-byte little-endian int64 make-shards writes."""

from __future__ import annotations

import numpy as np

from data_pipeline.shardset.tar_index import Component, TarSample

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff", "ppm", "pgm")
LABEL_EXTENSION = "cls"
INT64_BYTES = 8


def image_component(sample: TarSample, extensions: tuple[str, ...] = IMAGE_EXTENSIONS) -> Component | None:
    for extension in extensions:
        found = sample.find(extension)
        if found is not None:
            return found
    return None


def parse_label(raw: bytes) -> int:
    """The integer a ``.cls`` component holds; ``ValueError`` if it is neither form."""
    text = raw.strip()
    if text and text.lstrip(b"-").isdigit():
        return int(text)
    if len(raw) == INT64_BYTES:
        return int(np.frombuffer(raw, dtype="<i8")[0])
    raise ValueError(f".cls holds {raw[:16]!r}, neither an ASCII integer nor an 8-byte int64")
