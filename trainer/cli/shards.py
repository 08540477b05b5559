"""`instcls make-shards` (WebDataset shards, DALI indexes, sample table and manifest from a source,
or existing tars indexed in place), `instcls merge-shards`, `instcls upgrade-shards` and
`instcls validate-shards`."""

from __future__ import annotations

import argparse
from pathlib import Path

SOURCES = ["folder", "list", "tars", "digits", "digit-scenes", "synthetic"]
LABELS = {"folder": ("none", "subfolders"), "list": ("none", "column"), "tars": ("none", "cls")}


def register(commands) -> None:
    from data_pipeline.scenes import DIGIT_FRACTION, MAX_ANGLE
    from data_pipeline.shards import ShardSettings
    from data_pipeline.tar_labels import IMAGE_EXTENSIONS

    defaults = ShardSettings()
    parser = commands.add_parser("make-shards", help="write WebDataset shards + DALI indexes + sample table + manifest")
    parser.add_argument("--source", required=True, choices=SOURCES,
                        help="folder: every image under --root, at any depth (links followed); list: the paths in "
                        "--list (text, one a line, or CSV with a path column); tars: existing WebDataset tars under "
                        "--root, indexed in place (nothing re-encoded); digits: the labelled set inside scikit-learn; "
                        "digit-scenes: those digits drawn onto photo crops, gradients or flat colours (harder); "
                        "synthetic: random images")
    parser.add_argument("--out", type=Path, required=True,
                        help="output directory (for --source tars it may be --root itself); an unfinished ingest "
                        "there is resumed")
    parser.add_argument("--root", type=Path, help="folder and tars: the directory; list: base of relative paths "
                        "(default: the list file's directory)")
    parser.add_argument("--list", type=Path, help="list: a text file of image paths, or a CSV with path[,label]")
    parser.add_argument("--labels", default="none", choices=["none", "subfolders", "column", "cls"],
                        help="folder: subfolders (the first-level folder is the class); list: column (the CSV's "
                        "label column); tars: cls (each sample's .cls); default none (unlabelled)")
    parser.add_argument("--part", default="0/1", help="I/K: write only part I (0-based) of K, e.g. one per machine or "
                        "k8s Indexed Job completion; then `instcls merge-shards OUT` (default %(default)s: all, merged)")
    parser.add_argument("--workers", type=int, default=defaults.workers,
                        help="processes that check/encode images (default 0: every CPU this process may use)")
    parser.add_argument("--on-bad-image", default=defaults.on_bad_image, choices=["error", "skip"],
                        help="stop the run on an undecodable image (default; the finished shards are kept) or skip "
                        "it and list it in OUT/skipped.jsonl")
    parser.add_argument("--image-ext", default=",".join(IMAGE_EXTENSIONS[:4]),
                        help="tars: a sample's image is its first component with one of these extensions, in this "
                        "order (default %(default)s)")
    parser.add_argument("--count", type=int, default=1000, help="number of synthetic images")
    parser.add_argument("--image-size", type=int, default=32, help="side of digits/digit-scenes/synthetic images in pixels")
    parser.add_argument("--split", default="all", choices=["all", "train", "val"],
                        help="digits and digit-scenes: the fixed 20%% held-out digits (val) or the rest (train)")
    parser.add_argument("--renders-per-digit", type=int, default=3,
                        help="digit-scenes: scenes drawn per digit (default %(default)s)")
    parser.add_argument("--backgrounds", type=int, default=0,
                        help="digit-scenes: number of shared background crops (default 0: a fresh crop per scene)")
    parser.add_argument("--background", default="photo", choices=["photo", "gradient", "flat"],
                        help="digit-scenes: crops of embedded photos, two-colour gradients or one flat colour "
                        "(default %(default)s; the demo uses flat)")
    parser.add_argument("--colour-mix", type=float, default=0.3,
                        help="digit-scenes: how much of a random colour survives in the digit (0: black or white; "
                        "default %(default)s)")
    parser.add_argument("--max-angle", type=float, default=MAX_ANGLE,
                        help="digit-scenes: largest turn of a digit in degrees (default %(default)s)")
    parser.add_argument("--digit-size", type=float, nargs=2, default=DIGIT_FRACTION, metavar=("MIN", "MAX"),
                        help="digit-scenes: range of a digit's side as a fraction of the image's (default %(default)s)")
    parser.add_argument("--prefix", default=defaults.prefix, help="shard file prefix: PREFIX-000000.tar")
    parser.add_argument("--samples-per-shard", type=int, default=defaults.samples_per_shard)
    parser.add_argument("--max-side", type=int, help="shrink images whose longer side exceeds this")
    parser.add_argument("--seed", type=int, default=defaults.seed,
                        help="seed of the stored sample order (and of synthetic images and digit scenes)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    parser.set_defaults(handler=_run_make_shards)
    _add_merge_shards(commands)
    _add_upgrade_shards(commands)
    _add_validate_shards(commands)


def _image_source(args: argparse.Namespace):
    from data_pipeline import file_sources, sources

    if args.source == "folder":
        if args.root is None:
            raise ValueError("--source folder needs --root ROOT (a directory of images, at any depth)")
        return file_sources.image_folder(args.root, labels=args.labels == "subfolders")
    if args.source == "list":
        if args.list is None:
            raise ValueError("--source list needs --list FILE (one image path a line, or a CSV with a path column)")
        return file_sources.image_list(args.list, args.root, labels=args.labels == "column")
    if args.source == "digits":
        return sources.sklearn_digits(args.image_size, split=args.split)
    if args.source == "digit-scenes":
        return sources.digits_on_photos(args.image_size, split=args.split, renders_per_digit=args.renders_per_digit,
                                        seed=args.seed, backgrounds=args.backgrounds, background=args.background,
                                        colour_mix=args.colour_mix, max_angle=args.max_angle,
                                        digit_fraction=tuple(args.digit_size))
    return sources.synthetic(args.count, args.image_size, args.seed)


def _run_make_shards(args: argparse.Namespace) -> int:
    from data_pipeline.ingest_state import Part
    from data_pipeline.shards import ShardSettings, write_shards
    from data_pipeline.tar_source import index_tars

    allowed = LABELS.get(args.source, ("none",))
    if args.labels not in allowed:
        raise ValueError(f"--labels {args.labels} does not apply to --source {args.source}; choose one of {allowed}")
    part = Part.parse(args.part)
    if args.source == "tars":
        if args.root is None:
            raise ValueError("--source tars needs --root DIR (the directory holding the WebDataset tars)")
        manifest = index_tars(args.root, args.out, labels=args.labels == "cls",
                              image_extensions=tuple(e.strip().lstrip(".") for e in args.image_ext.split(",")),
                              on_bad_image=args.on_bad_image, workers=args.workers, progress=not args.no_progress,
                              part=part)
    else:
        settings = ShardSettings(prefix=args.prefix, samples_per_shard=args.samples_per_shard,
                                 on_bad_image=args.on_bad_image, seed=args.seed, workers=args.workers,
                                 max_side=args.max_side)
        manifest = write_shards(_image_source(args), args.out, settings, progress=not args.no_progress, part=part)
    if manifest is None:
        print(f"part {part} of {args.out} done; once every part is, run `instcls merge-shards {args.out}`")
        return 0
    _say_written(manifest, args.out)
    return 0


def _say_written(manifest, out: Path) -> None:
    skipped = manifest.num_skipped
    print(f"wrote {manifest.num_instances} instances in {len(manifest.shards)} shard(s) to {out}"
          + (f"; skipped {skipped} unusable image(s), listed in {out / manifest.skipped_report}" if skipped else ""))


def _add_merge_shards(commands) -> None:
    parser = commands.add_parser("merge-shards", help="after every make-shards --part: write the manifest and the "
                                 "sample table")
    parser.add_argument("out", type=Path, help="the --out of the parts")
    parser.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                        help="wait up to this long for the parts to finish (a merge Job started beside them)")
    parser.set_defaults(handler=_run_merge_shards)


def _run_merge_shards(args: argparse.Namespace) -> int:
    from data_pipeline.shard_merge import merge_shards

    _say_written(merge_shards(args.out, wait_seconds=args.wait), args.out)
    return 0


def _add_upgrade_shards(commands) -> None:
    parser = commands.add_parser("upgrade-shards", help="write the sample table of a shard set made by an older "
                                 "make-shards (the tars are not touched)")
    parser.add_argument("shards", type=Path, help="directory with manifest.json")
    parser.set_defaults(handler=_run_upgrade_shards)


def _run_upgrade_shards(args: argparse.Namespace) -> int:
    from data_pipeline.legacy_table import upgrade_shard_set

    manifest = upgrade_shard_set(args.shards)
    print(f"{args.shards}: sample table {manifest.table} of {manifest.num_instances} instances; manifest format 2")
    return 0


def _add_validate_shards(commands) -> None:
    parser = commands.add_parser("validate-shards", help="decode and check every sample of a shard set")
    parser.add_argument("shards", type=Path, help="directory with manifest.json")
    parser.add_argument("--workers", type=int, default=2, help="processes that check shards in parallel")
    parser.set_defaults(handler=_run_validate_shards)


def _run_validate_shards(args: argparse.Namespace) -> int:
    from data_pipeline.validate import validate_shards

    checked, problems = validate_shards(args.shards, workers=args.workers)
    for problem in problems:
        print(f"PROBLEM {problem}")
    print(f"checked {checked} samples in {args.shards}: " + (f"{len(problems)} problem(s)" if problems else "all good"))
    return 1 if problems else 0
