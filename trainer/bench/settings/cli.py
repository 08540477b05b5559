"""`instcls bench cli`'s settings: its command-line options (see ``trainer.bench.settings``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CliBenchSettings:
    """Attributes:
    repeats: timed runs of each command, each in a fresh process (the median is reported).
    warmup: untimed runs of each command first (the files they read come into the page cache).
    """

    repeats: int = 5
    warmup: int = 1

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError(f"--repeats {self.repeats} --warmup {self.warmup}: time at least one run (--repeats 1) "
                             "after zero or more warm-up runs")
