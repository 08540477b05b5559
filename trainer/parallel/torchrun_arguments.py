"""Reading torchrun's own options out of the arguments `instcls launch` passes it (before ``-m MODULE``
or the script: what follows belongs to the training program)."""

from __future__ import annotations


def options_end(arguments: list[str]) -> int:
    """Where torchrun's own options end: at ``-m MODULE`` or the script."""
    for index, argument in enumerate(arguments):
        if argument in ("-m", "--module") or argument.endswith(".py"):
            return index
    return len(arguments)


def option_value(arguments: list[str], *names: str) -> str | None:
    """The last value of any of ``names`` among torchrun's options (``--x V`` or ``--x=V``), as
    torchrun's parser keeps the last one given."""
    found = None
    options = arguments[:options_end(arguments)]
    for index, argument in enumerate(options):
        flag, equals, inline = argument.partition("=")
        if flag in names:
            found = inline if equals else (options[index + 1] if index + 1 < len(options) else None)
    return found
