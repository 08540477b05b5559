"""Images a user already has as files: a folder (flat or nested, labels optional) or a list of paths.

Both list paths in a fixed order (a folder: walked in sorted order; a list: its line order), so
the same inputs give the same ids.  At ImageNet-21K scale (14.2M files) a ``SourceImage`` per file
would cost gigabytes, so the listing is kept as path strings and labels, and records are made
when asked for (``FileImages``).

Symbolic links are followed (a tree of links into a data lake is a common way to select images);
a link to a directory already being walked is skipped, so a loop ends.  A broken link is listed
and fails when read, like any unreadable image (``--on-bad-image``).
"""

from __future__ import annotations

import csv
import hashlib
import os
from collections.abc import Sequence
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


def _walk(root: Path) -> list[str]:
    """Image files under ``root`` (links followed, loops cut), ``root``-relative, in sorted order:
    a directory's files, then its subdirectories, each in name order."""
    found: list[str] = []
    walking: set[tuple[int, int]] = set()

    def visit(directory: str, relative: str) -> None:
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
                found.append(name)  # a broken link too: reading it fails and is reported
        for path, name in subdirectories:
            visit(path, name)
        walking.discard(identity)

    visit(str(root), "")
    return found


def image_folder(root: Path, labels: bool = False) -> Source:
    """Every image under ``root``, at any depth.  ``labels``: the class is the first-level
    subfolder (``root/<class>/.../<image>``, classes in sorted order); otherwise no labels."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"image folder {root} does not exist; pass a directory of images (--root)")
    paths = _walk(root)
    if not paths:
        raise ValueError(f"image folder {root} contains no images with suffixes {sorted(IMAGE_SUFFIXES)}")
    class_names, label_array = None, None
    if labels:
        loose = [path for path in paths if "/" not in path]
        if loose:
            raise ValueError(f"{root / loose[0]} (and {len(loose) - 1} more) is not in a class subfolder, so "
                             f"--labels subfolders cannot label it; move it into {root}/<class>/ or use --labels none")
        classes = [path.split("/", 1)[0] for path in paths]
        class_names = sorted(set(classes))
        index = {name: number for number, name in enumerate(class_names)}
        label_array = np.array([index[name] for name in classes], dtype=np.int32)
    kind = "folder+labels" if labels else "folder"
    return Source(name=f"{kind}:{root}", images=FileImages(root, paths, label_array), class_names=class_names)


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
    label_values: list[str] = []
    if list_file.suffix.lower() == ".csv":
        with open(list_file, newline="") as handle:
            reader = csv.DictReader(handle)
            columns = reader.fieldnames or []
            wanted = ["path"] + (["label"] if labels else [])
            if any(column not in columns for column in wanted):
                raise ValueError(
                    f"{list_file}: the header {columns} lacks column(s) "
                    f"{[c for c in wanted if c not in columns]}; add them or use --labels none"
                )
            rows = list(reader)
        paths = [(row["path"] or "").strip() for row in rows]
        empty = next((number for number, path in enumerate(paths, start=2) if not path), None)
        if empty is not None:
            raise ValueError(f"{list_file}: line {empty} has an empty path; remove the line or fill it in")
        label_values = [row["label"] for row in rows] if labels else []
    else:
        if labels:
            raise ValueError(
                f"{list_file}: a plain list has no labels; give a CSV with path,label columns or use --labels none"
            )
        lines = (line.strip() for line in list_file.read_text().splitlines())
        paths = [line for line in lines if line and not line.startswith("#")]
    if not paths:
        raise ValueError(f"{list_file} lists no images")
    class_names, label_array = None, None
    if labels:
        class_names = sorted(set(label_values))
        index = {name: number for number, name in enumerate(class_names)}
        label_array = np.array([index[value] for value in label_values], dtype=np.int32)
    kind = "list+labels" if labels else "list"
    return Source(name=f"{kind}:{list_file}", images=FileImages(root, paths, label_array), class_names=class_names)


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
