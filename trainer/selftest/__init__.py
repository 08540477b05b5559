"""``instcls selftest``: what a new node or cluster must pass before a long job (see ``runner``)."""

from trainer.selftest.report import CheckResult, format_table
from trainer.selftest.runner import run_selftest

__all__ = ["CheckResult", "format_table", "run_selftest"]
