"""Command-line options made from a settings dataclass, so a benchmark's knobs are declared once.

For each field of the dataclass, ``add_settings_options`` adds ``--field-name`` (underscores
become dashes; the parsed value keeps the field's name) with

- the type from the field's annotation: ``int``, ``float``, ``str``, ``Path``; ``X | None`` as
  ``X``; ``Literal[...]`` as a choice; ``tuple[str, ...]`` as one comma-separated value; ``bool``
  as a switch (``store_true``, so such a field must default to False);
- the default from an instance made with no arguments (so a ``default_factory`` is honoured);
- the help text from the field's entry in the docstring's ``Attributes:`` section (Google style,
  as in ``trainer/config.py``), followed by the default unless the entry speaks of its default.

The docstring is the one place a field is described: the help cannot drift from the code, and a
field without an entry is refused when the parser is built, naming the class and the field.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import types
import typing
from pathlib import Path

# ``name: text`` or ``name, other: text`` at the start of an Attributes entry.
_ENTRY = re.compile(r"^(\w+(?:\s*,\s*\w+)*)\s*:\s*(.*)$")


def field_docs(settings_class: type) -> dict[str, str]:
    """Field name -> its text in the ``Attributes:`` section of the class docstring.

    An entry starts at the section's indentation with ``name:`` and goes on over the more deeply
    indented lines after it; a line less indented than the entries ends the section."""
    lines = inspect.cleandoc(settings_class.__doc__ or "").splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Attributes:")
    except StopIteration:
        return {}
    docs: dict[str, str] = {}
    names: list[str] = []
    entry_indent = None
    for line in lines[start + 1:]:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if entry_indent is None:
            entry_indent = indent
        if indent < entry_indent:
            break
        entry = _ENTRY.match(line.strip()) if indent == entry_indent else None
        if entry:
            names = [name.strip() for name in entry.group(1).split(",")]
            for name in names:
                docs[name] = entry.group(2)
        else:
            for name in names:
                docs[name] += " " + line.strip()
    return docs


def comma_separated(text: str) -> tuple[str, ...]:
    return tuple(text.split(","))


def add_settings_options(parser: argparse.ArgumentParser, settings_class: type, skip: tuple[str, ...] = ()) -> None:
    """An option per field of the dataclass ``settings_class`` except those named in ``skip``
    (fields the command sets another way, or not at all)."""
    defaults = settings_class()
    hints = typing.get_type_hints(settings_class)
    docs = field_docs(settings_class)
    for field in dataclasses.fields(settings_class):
        if field.name in skip:
            continue
        if field.name not in docs:
            raise TypeError(f"{settings_class.__qualname__}.{field.name} has no help text: add a line "
                            f"'{field.name}: what it sets' to the Attributes: section of its docstring")
        default = getattr(defaults, field.name)
        option = _option_kwargs(settings_class, field.name, hints[field.name], default)
        help_text = docs[field.name].rstrip(".").replace("%", "%%")  # a sentence in the docstring, a phrase in --help
        if default is not None and option.get("action") != "store_true" and "default" not in help_text:
            help_text += " (default %(default)s)"
        parser.add_argument("--" + field.name.replace("_", "-"), help=help_text, **option)


def settings_from_args(settings_class: type, args: argparse.Namespace, **computed):
    """The settings from the parsed options: each field that ``args`` holds, then ``computed``
    (fields the command derives, such as bytes from an option in GiB); the rest keep defaults."""
    values = {field.name: getattr(args, field.name) for field in dataclasses.fields(settings_class)
              if hasattr(args, field.name)}
    return settings_class(**{**values, **computed})


def _option_kwargs(settings_class: type, name: str, hint, default) -> dict:
    """``add_argument`` keywords for a field annotated ``hint`` (``X | None`` is read as ``X``)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        options = [option for option in typing.get_args(hint) if option is not type(None)]
        hint = options[0] if len(options) == 1 else hint
    if hint is bool:
        if default:
            raise TypeError(f"{settings_class.__qualname__}.{name} defaults to True: a switch can only turn a "
                            "field on; rename it so that its default is False")
        return {"action": "store_true"}
    if typing.get_origin(hint) is typing.Literal:
        return {"choices": list(typing.get_args(hint)), "default": default}
    if typing.get_origin(hint) is tuple and typing.get_args(hint) == (str, ...):
        # A string default goes through ``type`` like a typed value, and shows as typed in --help.
        return {"type": comma_separated, "default": ",".join(default)}
    if hint in (int, float, Path):
        return {"type": hint, "default": default}
    if hint is str:
        return {"default": default}
    raise TypeError(f"{settings_class.__qualname__}.{name}: no command-line option for a field of type {hint}; "
                    "use int, float, str, Path, bool, a Literal, tuple[str, ...] or one of them | None")
