"""`instcls bench exporter`'s settings: its command-line options (see ``trainer.bench.settings``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class ExporterBenchSettings:
    """Attributes:
    scrapers: concurrent scrapers of /metrics.
    seconds: length of each window, loaded or quiet.
    rounds: quiet/loaded window pairs.
    batch: images per training step.
    image_size: side of the random training images.
    arch: the backbone trained while scraped.
    """

    scrapers: int = 50
    seconds: float = 10.0
    rounds: int = 3
    batch: int = 64
    image_size: int = 32
    arch: Literal["resnet18", "resnet50"] = "resnet18"
