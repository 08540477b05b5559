"""`instcls make-shards` (WebDataset shards, DALI indexes and a manifest from a source) and
`instcls validate-shards`."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(commands) -> None:
    from data_pipeline.scenes import DIGIT_FRACTION, MAX_ANGLE
    from data_pipeline.shards import ShardSettings

    defaults = ShardSettings()
    parser = commands.add_parser("make-shards", help="write WebDataset shards + DALI indexes + manifest")
    parser.add_argument("--source", required=True, choices=["digits", "digit-scenes", "synthetic", "folder"],
                        help="digits: the labelled set inside scikit-learn; digit-scenes: those digits drawn "
                        "at random places and colours onto photo crops, gradients or flat colours (harder); "
                        "synthetic: random images; "
                        "folder: an image tree ROOT/<class>/<image> given with --root")
    parser.add_argument("--out", type=Path, required=True, help="output directory (must hold no manifest yet)")
    parser.add_argument("--root", type=Path, help="image-folder root for --source folder")
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
    parser.add_argument("--on-bad-image", default=defaults.on_bad_image, choices=["error", "skip"],
                        help="refuse the whole run on an undecodable image (default) or skip and count it")
    parser.add_argument("--max-side", type=int, help="shrink images whose longer side exceeds this")
    parser.add_argument("--seed", type=int, default=defaults.seed,
                        help="seed of the stored sample order (and of synthetic images and digit scenes)")
    parser.add_argument("--workers", type=int, default=defaults.workers, help="processes that check/encode images")
    parser.set_defaults(handler=_run_make_shards)
    _add_validate_shards(commands)


def _run_make_shards(args: argparse.Namespace) -> int:
    from data_pipeline import sources
    from data_pipeline.shards import ShardSettings, write_shards

    if args.source == "folder":
        if args.root is None:
            raise ValueError("--source folder needs --root ROOT (a directory with one subfolder per class)")
        source = sources.image_folder(args.root)
    elif args.source == "digits":
        source = sources.sklearn_digits(args.image_size, split=args.split)
    elif args.source == "digit-scenes":
        source = sources.digits_on_photos(args.image_size, split=args.split,
                                          renders_per_digit=args.renders_per_digit, seed=args.seed,
                                          backgrounds=args.backgrounds, background=args.background,
                                          colour_mix=args.colour_mix, max_angle=args.max_angle,
                                          digit_fraction=tuple(args.digit_size))
    else:
        source = sources.synthetic(args.count, args.image_size, args.seed)
    settings = ShardSettings(prefix=args.prefix, samples_per_shard=args.samples_per_shard,
                             on_bad_image=args.on_bad_image, seed=args.seed, workers=args.workers,
                             max_side=args.max_side)
    manifest = write_shards(source, args.out, settings)
    print(f"wrote {manifest.num_instances} instances in {len(manifest.shards)} shard(s) to {args.out}"
          + (f"; skipped {len(manifest.skipped)} unreadable image(s), listed in the manifest" if manifest.skipped else ""))
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
