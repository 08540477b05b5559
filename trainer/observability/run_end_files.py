"""The files that close a tracked run: ``summary.json`` (rank 0's summary record) and
``model_card.md`` (the card ``instcls export`` writes for the last checkpoint), written to
``logging.dir`` and handed to the trackers that keep files (MLflow's artifacts).

The card comes from the export layer, above the engine: whoever starts the trainer passes it in
(``model_card``: the command line passes ``trainer.export.card_only.model_card_of``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

SUMMARY_FILE, MODEL_CARD_FILE = "summary.json", "model_card.md"


def attach_run_end(log, config, summary: dict, last_checkpoint: Path | None, say: Callable[[str], None],
                   model_card: Callable[[object, Path], str] | None) -> None:
    """Rank 0, after the summary record: a card that cannot be made (a network without an export
    mapping) is said, and the run still ends as it would have."""
    log_dir = Path(config.logging.dir)
    summary_file = log_dir / SUMMARY_FILE
    summary_file.write_text(json.dumps(summary, indent=1) + "\n")
    log.attach(summary_file, SUMMARY_FILE)
    if last_checkpoint is None or model_card is None:
        return
    try:
        text = model_card(config, Path(last_checkpoint))
    except (ValueError, OSError, KeyError) as error:
        say(f"warning: no model card for the trackers: exporting {last_checkpoint} failed ({error})")
        return
    card = log_dir / MODEL_CARD_FILE
    card.write_text(text)
    log.attach(card, MODEL_CARD_FILE)
