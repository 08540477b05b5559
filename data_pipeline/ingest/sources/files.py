"""Images a user already has as files: a folder (flat or nested, labels optional) or a list of paths.

Both list paths in a fixed order (a folder: walked in sorted order; a list: its line order), so
the same inputs give the same ids.  At ImageNet-21K scale (14.2M files) even the paths are
gigabytes, and a part of an ingest needs only its share: so the listing is streamed
(``FileListing``: one pass counts it, digests the paths and finds the classes; a later pass keeps
the entries a part asks for, held as path strings and labels, ``FileImages``), and records are
made when asked for.

Symbolic links are followed (a tree of links into a data lake is a common way to select images);
a link to a directory already being walked is skipped, so a loop ends.  A broken link is listed
and fails when read, like any unreadable image (``--on-bad-image``).
"""

from __future__ import annotations

import csv
import hashlib
import os
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path

import numpy as np

from data_pipeline.ingest.sources.generated import IMAGE_SUFFIXES, NO_LABEL, Source, SourceImage
from data_pipeline.ingest.sources.registry import Flag, SourceKind


def read_file(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


class FileImages(Sequence):
    """``SourceImage`` records made on demand from ``root``-relative paths and int32 labels."""

    def __init__(self, root: Path, paths: list[str], labels: np.ndarray | None) -> None:
        self.root, self.paths = str(root), paths
        self.labels = np.full(len(paths), NO_LABEL, dtype=np.int32) if labels is None else labels.astype(np.int32)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        path = os.path.join(self.root, self.paths[index])
        return SourceImage(origin=path, label=int(self.labels[index]), read=partial(read_file, path))

    def sha256(self) -> str:
        """Digest of the listing: paths in order and their labels."""
        digest = hashlib.sha256()
        for path in self.paths:
            digest.update(path.encode("utf-8", "surrogateescape") + b"\n")
        digest.update(self.labels.tobytes())
        return digest.hexdigest()


Entries = Callable[[], Iterator[tuple[str, str | None]]]  # (path, class name or None), listing order


class FileListing:
    """The images of a folder or list file, streamed from ``entries()`` at each pass, never all held.

    The first pass (here) counts them, digests their paths and collects the class names (labels:
    a class's rank among the sorted names).  ``share`` keeps the entries at some positions (a part's
    share of an ingest) and, in the same pass, digests the labels, which completes ``sha256``: the
    digest of ``FileImages`` over the whole listing.  Iterating makes every record, one at a time."""

    _LABEL_BLOCK = 1 << 16

    def __init__(self, root: Path, entries: Entries, labelled: bool) -> None:
        self.root, self._entries, self.labelled = str(root), entries, labelled
        count, digest, names = 0, hashlib.sha256(), set()
        for path, name in entries():
            count += 1
            digest.update(path.encode("utf-8", "surrogateescape") + b"\n")
            if labelled:
                names.add(name)
        self.count, self._paths_digest, self._digest = count, digest, None
        self.class_names = sorted(names) if labelled else None
        self._label_of = {name: number for number, name in enumerate(self.class_names or [])}

    def __len__(self) -> int:
        return self.count

    def _labelled(self) -> Iterator[tuple[str, int]]:
        for path, name in self._entries():
            yield path, self._label_of[name] if self.labelled else NO_LABEL

    def __iter__(self) -> Iterator[SourceImage]:
        for path, label in self._labelled():
            path = os.path.join(self.root, path)
            yield SourceImage(origin=path, label=label, read=partial(read_file, path))

    def share(self, positions: np.ndarray) -> FileImages:
        """The entries at ``positions`` (ascending listing positions), in that order."""
        paths, labels, wanted, block, seen = [], [], 0, [], 0
        digest = None if self._digest is not None else self._paths_digest.copy()
        for position, (path, label) in enumerate(self._labelled()):
            seen += 1
            if wanted < len(positions) and position == positions[wanted]:
                paths.append(path)
                labels.append(label)
                wanted += 1
            if digest is not None:
                block.append(label)
                if len(block) == self._LABEL_BLOCK:
                    digest.update(np.array(block, dtype=np.int32).tobytes())
                    block = []
        if seen != self.count or wanted != len(positions):
            raise ValueError(f"{self.root}: the listing changed while it was read ({self.count} entries at first, "
                             f"{seen} now); run again once it holds still")
        if digest is not None:
            digest.update(np.array(block, dtype=np.int32).tobytes())
            self._digest = digest.hexdigest()
        return FileImages(Path(self.root), paths, np.array(labels, dtype=np.int32))

    def sha256(self) -> str:
        """Digest of the listing: paths in order, then their labels (int32), as ``FileImages.sha256``."""
        if self._digest is None:
            if self.labelled:
                self.share(np.empty(0, dtype=np.int64))  # one pass for the labels
            else:
                digest = self._paths_digest.copy()
                for start in range(0, self.count, self._LABEL_BLOCK):
                    digest.update(np.full(min(self._LABEL_BLOCK, self.count - start), NO_LABEL, np.int32).tobytes())
                self._digest = digest.hexdigest()
        return self._digest


def _walk(root: Path) -> Iterator[str]:
    """Image files under ``root`` (links followed, loops cut), ``root``-relative, in sorted order:
    a directory's files, then its subdirectories, each in name order."""
    walking: set[tuple[int, int]] = set()

    def visit(directory: str, relative: str) -> Iterator[str]:
        status = os.stat(directory)
        identity = (status.st_dev, status.st_ino)
        if identity in walking:  # a link back into the directories being walked: a loop
            return
        walking.add(identity)
        with os.scandir(directory) as entries:
            entries = sorted(entries, key=lambda entry: entry.name)
        subdirectories = []
        for entry in entries:
            if entry.name.startswith("."):
                continue
            try:
                is_dir = entry.is_dir()  # follows links
            except OSError:
                is_dir = False
            name = f"{relative}{entry.name}"
            if is_dir:
                subdirectories.append((entry.path, name + "/"))
            elif os.path.splitext(entry.name)[1].lower() in IMAGE_SUFFIXES:
                yield name  # a broken link too: reading it fails and is reported
        del entries
        for path, name in subdirectories:
            yield from visit(path, name)
        walking.discard(identity)

    yield from visit(str(root), "")


def _folder_entries(root: Path, labels: bool) -> Iterator[tuple[str, str | None]]:
    loose: list[str] = []  # with labels: images directly in root, which come first in the walk
    for path in _walk(root):
        if labels and "/" not in path:
            loose.append(path)
            continue
        if loose:
            break
        yield path, path.split("/", 1)[0] if labels else None
    if loose:
        raise ValueError(f"{root / loose[0]} (and {len(loose) - 1} more) is not in a class subfolder, so --labels "
                         f"subfolders cannot label it; move it into {root}/<class>/ or use --labels none")


def image_folder(root: Path, labels: bool = False) -> Source:
    """Every image under ``root``, at any depth.  ``labels``: the class is the first-level
    subfolder (``root/<class>/.../<image>``, classes in sorted order); otherwise no labels."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"image folder {root} does not exist; pass a directory of images (--root)")
    listing = FileListing(root, lambda: _folder_entries(root, labels), labelled=labels)
    if not len(listing):
        raise ValueError(f"image folder {root} contains no images with suffixes {sorted(IMAGE_SUFFIXES)}")
    kind = "folder+labels" if labels else "folder"
    return Source(name=f"{kind}:{root}", images=listing, class_names=listing.class_names)


def _csv_entries(list_file: Path, labels: bool) -> Iterator[tuple[str, str | None]]:
    with open(list_file, newline="") as handle:
        reader = csv.reader(handle)  # not DictReader: a dict per row would double the time of a pass
        columns = next(reader, [])
        wanted = ["path"] + (["label"] if labels else [])
        if any(column not in columns for column in wanted):
            raise ValueError(
                f"{list_file}: the header {columns} lacks column(s) "
                f"{[c for c in wanted if c not in columns]}; add them or use --labels none"
            )
        path_at, label_at = columns.index("path"), columns.index("label") if labels else None
        for line, row in enumerate(reader, start=2):
            if not row:  # a blank line: DictReader skipped it too
                continue
            path = row[path_at].strip() if path_at < len(row) else ""
            if not path:
                raise ValueError(f"{list_file}: line {line} has an empty path; remove the line or fill it in")
            yield path, (row[label_at] if label_at < len(row) else "") if labels else None


def _text_entries(list_file: Path) -> Iterator[tuple[str, None]]:
    with open(list_file) as handle:
        for line in handle:
            path = line.strip()
            if path and not path.startswith("#"):
                yield path, None


def image_list(list_file: Path, root: Path | None = None, labels: bool = False) -> Source:
    """The images a list file names, in its order.  A ``.csv`` file has a header with a ``path``
    column and, for ``labels``, a ``label`` column (class names: its distinct values, sorted);
    any other file has one path a line (``#`` comments and blank lines skipped).  Relative paths
    are relative to ``root`` (default: the list file's directory)."""
    list_file = Path(list_file)
    if not list_file.is_file():
        raise FileNotFoundError(f"list file {list_file} does not exist; pass a text or CSV file of image paths "
                                "(--list)")
    root = list_file.parent if root is None else Path(root)
    if list_file.suffix.lower() == ".csv":
        entries = lambda: _csv_entries(list_file, labels)  # noqa: E731
    elif labels:
        raise ValueError(
            f"{list_file}: a plain list has no labels; give a CSV with path,label columns or use --labels none"
        )
    else:
        entries = lambda: _text_entries(list_file)  # noqa: E731
    listing = FileListing(root, entries, labelled=labels)
    if not len(listing):
        raise ValueError(f"{list_file} lists no images")
    kind = "list+labels" if labels else "list"
    return Source(name=f"{kind}:{list_file}", images=listing, class_names=listing.class_names)


# --- as `instcls make-shards --source folder | list` ---------------------------------------------


def _open_folder(args) -> Source:
    if args.root is None:
        raise ValueError("--source folder needs --root ROOT (a directory of images, at any depth)")
    return image_folder(args.root, labels=args.labels == "subfolders")


def _open_list(args) -> Source:
    if args.list is None:
        raise ValueError("--source list needs --list FILE (one image path a line, or a CSV with a path column)")
    return image_list(args.list, args.root, labels=args.labels == "column")


_ROOT = {"type": Path}
FOLDER = SourceKind(
    "folder",
    "every image under --root, at any depth (links followed)",
    (Flag("--root", "the directory", _ROOT),),
    labels=("none", "subfolders"),
    open=_open_folder,
)
LIST = SourceKind(
    "list",
    "the paths in --list (text, one a line, or CSV with a path column)",
    (
        Flag("--root", "base of relative paths (default: the list file's directory)", _ROOT),
        Flag("--list", "a text file of image paths, or a CSV with path[,label]", {"type": Path}),
    ),
    labels=("none", "column"),
    open=_open_list,
)
