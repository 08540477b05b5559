"""`instcls bench eval`'s settings: its command-line options (see ``trainer.bench.settings``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EvalBenchSettings:
    """Attributes:
    config: the job config whose backbone, loader and ``eval.linear`` are timed (its shard paths are
        replaced by the digits).
    rows: bank rows of the synthetic probe timing (ImageNet-1K's share per rank on 64 ranks is 20,019:
        a CPU takes minutes an epoch on it, so the default times a tenth and reports the rate).
    width: their feature width (ResNet-50's 2048).
    classes: their classes (1000).
    epochs: SGD probe epochs timed on them.
    """

    config: Path = Path("configs/demo_cpu.yaml")
    rows: int = 2_000
    width: int = 2048
    classes: int = 1000
    epochs: int = 1

    def __post_init__(self) -> None:
        for name in ("rows", "width", "classes", "epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name}={getattr(self, name)} is invalid: use a positive number")
