"""The one way a settings dataclass reports a bad field: the field, its value, and the fix."""

from __future__ import annotations


def raise_first_invalid(config, checks: list[tuple[bool, str, str]], prefix: str = "") -> None:
    """``checks``: ``(ok, field, fix)``; the first failing one raises ``{prefix}field=value is invalid:
    fix`` (a job config adds its section's prefix, e.g. ``objective.``)."""
    for ok, name, fix in checks:
        if not ok:
            raise ValueError(f"{prefix}{name}={getattr(config, name)!r} is invalid: {fix}")
