"""What is where inside a WebDataset tar: its samples, each component's byte range, and DALI's
index file (``wds2idx`` format ``v1.2``) written from that.

A sample is a run of consecutive regular files sharing a key (the member name up to the first dot
of its last path part); the rest of the name is the component's extension (``jpg``, ``cls``,
``seg.png``).  This is the grouping of DALI's ``wds2idx``; offsets come from Python's ``tarfile``,
which follows pax and GNU long-name headers.  Members without an extension are not components.
"""

from __future__ import annotations

import os
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from trainer.temp_files import temp_sibling

INDEX_VERSION = "v1.2"
FIELDS_PER_COMPONENT = 4  # extension, offset, size, member name


@dataclass(frozen=True)
class Component:
    extension: str
    offset: int
    size: int
    name: str


@dataclass
class TarSample:
    key: str
    components: list[Component] = field(default_factory=list)

    def find(self, extension: str) -> Component | None:
        return next((c for c in self.components if c.extension == extension), None)


def split_name(name: str) -> tuple[str, str] | None:
    """``(key, extension)`` of a member name, or None when it has no extension."""
    dot = name.find(".", name.rfind("/") + 1)
    if dot <= name.rfind("/") + 1:  # no dot, or a hidden file (".foo")
        return None
    return name[:dot], name[dot + 1:]


def scan_tar(path: Path | BinaryIO) -> list[TarSample]:
    """The samples of ``path`` (a file, or a seekable binary file object) in member order (only
    headers are read)."""
    samples: list[TarSample] = []
    source = {"fileobj": path} if hasattr(path, "read") else {"name": path}
    with tarfile.open(mode="r:", **source) as archive:
        for member in archive:
            if not member.isfile():
                continue
            parts = split_name(member.name)
            if parts is None:
                continue
            key, extension = parts
            if not samples or samples[-1].key != key:
                samples.append(TarSample(key))
            samples[-1].components.append(Component(extension, member.offset_data, member.size, member.name))
    return samples


def write_dali_index(samples: list[TarSample], tar_path: Path, index_path: Path) -> None:
    """DALI's index of ``samples`` (what ``wds2idx`` writes for the same tar), atomically."""
    lines = [f"{INDEX_VERSION} {len(samples)}"]
    for sample in samples:
        fields = []
        for c in sample.components:
            if any(space in c.name for space in " \t\n\r"):
                raise ValueError(f"{tar_path}: member {c.name!r} has white space in its name, which DALI's index "
                                 "format cannot hold; rename the tar's members")
            fields.append(f"{c.extension} {c.offset} {c.size} {c.name}")
        lines.append(" ".join(fields))
    index_path = Path(index_path)
    tmp = temp_sibling(index_path)
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, index_path)


def read_dali_index(index_path: Path) -> list[TarSample]:
    """The samples an index file lists; ``ValueError`` naming the file and line if it is malformed."""
    return parse_dali_index(Path(index_path).read_text(), str(index_path))


def parse_dali_index(text: str, index_path: str) -> list[TarSample]:
    """The samples of an index file's ``text``; ``index_path`` names it in the errors."""
    lines = text.splitlines()
    header = lines[0].split() if lines else []
    if len(header) != 2 or header[0] != INDEX_VERSION or not header[1].isdigit():
        raise ValueError(f"{index_path}: header {' '.join(header)!r} is not '{INDEX_VERSION} <count>'")
    samples = []
    for number, line in enumerate(lines[1:], start=2):
        tokens = line.split()
        if not tokens or len(tokens) % FIELDS_PER_COMPONENT:
            raise ValueError(f"{index_path}: line {number} is not groups of <ext> <offset> <size> <name>")
        components = []
        for at in range(0, len(tokens), FIELDS_PER_COMPONENT):
            extension, offset, size, name = tokens[at:at + FIELDS_PER_COMPONENT]
            if not (offset.isdigit() and size.isdigit()):
                raise ValueError(f"{index_path}: line {number}: offset {offset!r} or size {size!r} is not a number")
            components.append(Component(extension, int(offset), int(size), name))
        parts = split_name(components[0].name)
        samples.append(TarSample(parts[0] if parts else components[0].name, components))
    if len(samples) != int(header[1]):
        raise ValueError(f"{index_path}: the header says {header[1]} samples, {len(samples)} lines follow")
    return samples
