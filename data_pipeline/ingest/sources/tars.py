"""`instcls make-shards --source tars`: existing WebDataset tars under --root, indexed in place
(nothing re-encoded); the work is ``data_pipeline.ingest.tars_in_place``."""

from __future__ import annotations

from pathlib import Path

from data_pipeline.ingest.sources.registry import Flag, SourceKind
from data_pipeline.shardset.tar_labels import IMAGE_EXTENSIONS


def _index_in_place(args, part):
    from data_pipeline.ingest.tars_in_place import index_tars  # it builds on the shard writer, which imports sources

    if args.root is None:
        raise ValueError("--source tars needs --root DIR (the directory holding the WebDataset tars)")
    return index_tars(args.root, args.out, labels=args.labels == "cls",
                      image_extensions=tuple(e.strip().lstrip(".") for e in args.image_ext.split(",")),
                      on_bad_image=args.on_bad_image, workers=args.workers, progress=not args.no_progress, part=part)


TARS = SourceKind(
    "tars", "existing WebDataset tars under --root, indexed in place (nothing re-encoded)",
    (Flag("--root", "the directory (--out may be --root itself)", {"type": Path}),
     Flag("--image-ext", "a sample's image is its first component with one of these extensions, in this order "
          f"(default {','.join(IMAGE_EXTENSIONS[:4])})", {"default": ",".join(IMAGE_EXTENSIONS[:4])})),
    labels=("none", "cls"), index_in_place=_index_in_place)
