"""`instcls bench classifier --peer torch`'s settings (see ``trainer.bench.settings``), and the settings of
torch's ``F.linear_cross_entropy`` that it and `bench ddp-vs-dhp` try, as the command line names them.

A setting is ``reference`` (``options=None``: ``linear`` then ``cross_entropy``, the whole
``[B, N]`` logits at once), ``auto`` (``LinearCrossEntropyOptions()``: torch picks the rows per
chunk) or a number, the ``batch_chunk_size`` (rows of the batch scored per chunk).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainer.checks import raise_first_invalid

REFERENCE = "reference"
AUTO = "auto"
# A few chunk sizes and the reference path.  "auto" is not among them: for a classifier of many
# more rows than features it picks one row per chunk (a pass over all of W per sample).
DEFAULT_TORCH_SETTINGS = ("32", "128", "512", REFERENCE)


def torch_settings_fix(settings: tuple[str, ...]) -> str | None:
    """What to change in a list of settings, or None when every one is valid."""
    bad = [s for s in settings if s not in (REFERENCE, AUTO) and not (s.isdigit() and int(s) > 0)]
    if not settings or bad:
        return (f"give comma-separated settings of torch's linear_cross_entropy, each '{REFERENCE}', '{AUTO}' or a "
                f"positive batch_chunk_size (e.g. {','.join(DEFAULT_TORCH_SETTINGS)}); not {','.join(bad) or 'none'}")
    return None


@dataclass(frozen=True)
class TorchPeerSettings:
    """What `instcls bench classifier --peer torch` adds to the classifier bench's settings.

    Attributes:
        peer: instead of DHP vs DDP, compare instcls's classifier with torch's fused op
            (torch.nn.functional.linear_cross_entropy) on the same problem, at T = 1 and on each rank
            of --ranks replicated (DDP) ranks.
        cap_gib: with --peer: memory cap per rank (GiB) for every run of both sides; a torch setting that
            fails to allocate under it is out.
        torch_settings: with --peer: the settings of torch's op tried, comma-separated: 'reference'
            (options=None, all logits at once), 'auto' (torch's own chunk size) or a batch_chunk_size;
            the fastest that fits the cap is torch's figure.
    """

    peer: Literal["torch"] | None = None
    cap_gib: float = 6.0
    torch_settings: tuple[str, ...] = DEFAULT_TORCH_SETTINGS

    def __post_init__(self) -> None:
        raise_first_invalid(self, [
            (self.cap_gib > 0, "cap_gib", "use a positive cap in GiB (--cap-gib)"),
            (torch_settings_fix(self.torch_settings) is None, "torch_settings",
             f"--torch-settings: {torch_settings_fix(self.torch_settings)}"),
        ])
