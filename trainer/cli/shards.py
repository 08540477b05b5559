"""`instcls make-shards` (WebDataset shards, DALI indexes, sample table and manifest from a source,
or existing tars indexed in place), `instcls merge-shards`, `instcls upgrade-shards` and
`instcls validate-shards`; make, merge and validate take a directory or an s3:// prefix."""

from __future__ import annotations

import argparse
from pathlib import Path

STAGING_HELP = ("with an s3:// set: the local directory its shards are written (and the merge done) in before "
                "they are uploaded; keep it to resume a killed run without rewriting shards whose upload was cut "
                "short (default: <temp dir>/instcls-staging/BUCKET/PREFIX)")


def register(commands) -> None:
    from data_pipeline.ingest.shard_settings import ShardSettings
    from data_pipeline.ingest.sources import add_source_arguments

    defaults = ShardSettings()
    parser = commands.add_parser("make-shards", help="write WebDataset shards + DALI indexes + sample table + manifest")
    add_source_arguments(parser)  # --source, --labels and each registered source's flags
    parser.add_argument("--out", required=True,
                        help="output directory (for --source tars it may be --root itself), or s3://BUCKET/PREFIX "
                        "(endpoint and credentials from AWS_ENDPOINT_URL_S3, AWS_ACCESS_KEY_ID, ...); an unfinished "
                        "ingest there is resumed")
    parser.add_argument("--staging", type=Path, help=STAGING_HELP)
    parser.add_argument(
        "--part",
        default="0/1",
        help="I/K: write only part I (0-based) of K, e.g. one per machine or "
        "k8s Indexed Job completion; then `instcls merge-shards OUT` (default %(default)s: all, merged)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=defaults.workers,
        help="processes that check/encode images (default 0: every CPU this process may use)",
    )
    parser.add_argument(
        "--on-bad-image",
        default=defaults.on_bad_image,
        choices=["error", "skip"],
        help="stop the run on an undecodable image (default; the finished shards are kept) or skip "
        "it and list it in OUT/skipped.jsonl",
    )
    parser.add_argument("--prefix", default=defaults.prefix, help="shard file prefix: PREFIX-000000.tar")
    parser.add_argument("--samples-per-shard", type=int, default=defaults.samples_per_shard)
    parser.add_argument("--max-side", type=int, help="shrink images whose longer side exceeds this")
    parser.add_argument(
        "--seed",
        type=int,
        default=defaults.seed,
        help="seed of the stored sample order (and of synthetic images and digit scenes)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    parser.add_argument("--listing-only", action="store_true",
                        help="list this part's share of the source and say how many images and shards it holds and "
                        "this process's peak memory; read and write no image (sizing a part's machine)")
    parser.set_defaults(handler=_run_make_shards)
    _add_merge_shards(commands)
    _add_upgrade_shards(commands)
    _add_validate_shards(commands)


def _run_make_shards(args: argparse.Namespace) -> int:
    from data_pipeline.ingest.ingest_state import Part
    from data_pipeline.ingest.make_shards import ShardSettings, write_shards
    from data_pipeline.ingest.parallel_ingest import open_target
    from data_pipeline.ingest.sources import check_labels, source_kind

    check_labels(args)
    kind, part = source_kind(args.source), Part.parse(args.part)
    if args.listing_only:
        return _list_only(kind, part, args)
    if kind.index_in_place is not None:
        if args.staging is not None:
            raise ValueError(f"--staging: --source {kind.name} indexes the tars where they are and stages nothing; "
                             "leave --staging out")
        manifest = kind.index_in_place(args, part)
    else:
        settings = ShardSettings(
            prefix=args.prefix,
            samples_per_shard=args.samples_per_shard,
            on_bad_image=args.on_bad_image,
            seed=args.seed,
            workers=args.workers,
            max_side=args.max_side,
        )
        target = open_target(args.out, args.staging)  # a bad bucket or finished set: before a long listing
        manifest = write_shards(kind.open(args), target, settings, progress=not args.no_progress, part=part)
    if manifest is None:
        print(f"part {part} of {args.out} done; once every part is, run `instcls merge-shards {args.out}`")
        return 0
    _say_written(manifest, args.out)
    return 0


def _list_only(kind, part, args: argparse.Namespace) -> int:
    import time

    from data_pipeline.ingest.part_listing import list_part
    from trainer.observability.memory import current_rss_bytes, peak_rss_bytes

    if kind.open is None:
        raise SystemExit(f"--listing-only: --source {kind.name} indexes tars in place, with no listing to cut; "
                         "leave the flag out")
    before, started = current_rss_bytes(), time.perf_counter()
    listing = list_part(kind.open(args), args.samples_per_shard, args.seed, part)
    print(f"part {part}: {len(listing.images):,} of {listing.count:,} images in {len(listing.offsets) - 1:,} of "
          f"{listing.num_shards:,} shards; listed in {time.perf_counter() - started:.1f} s; peak RSS "
          f"{peak_rss_bytes() / 2**20:,.0f} MiB ({before / 2**20:,.0f} MiB before listing); listing sha256 "
          f"{listing.sha256}")
    return 0


def _say_written(manifest, out: str) -> None:
    from data_pipeline.storage.shard_url import S3Url, shard_location

    skipped, location = manifest.num_skipped, shard_location(out)
    report = (location.child(manifest.skipped_report) if isinstance(location, S3Url)
              else location / manifest.skipped_report)
    print(
        f"wrote {manifest.num_instances} instances in {len(manifest.shards)} shard(s) to {location}"
        + (f"; skipped {skipped} unusable image(s), listed in {report}" if skipped else "")
    )


def _add_merge_shards(commands) -> None:
    parser = commands.add_parser(
        "merge-shards", help="after every make-shards --part: write the manifest and the sample table"
    )
    parser.add_argument("out", help="the --out of the parts (a directory or s3://BUCKET/PREFIX)")
    parser.add_argument("--staging", type=Path, help=STAGING_HELP)
    parser.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="wait up to this long for the parts to finish (a merge Job started beside them)",
    )
    parser.set_defaults(handler=_run_merge_shards)


def _run_merge_shards(args: argparse.Namespace) -> int:
    from data_pipeline.ingest.merge_any import merge_shard_set

    _say_written(merge_shard_set(args.out, wait_seconds=args.wait, staging=args.staging), args.out)
    return 0


def _add_upgrade_shards(commands) -> None:
    parser = commands.add_parser(
        "upgrade-shards",
        help="write the sample table of a shard set made by an older make-shards (the tars are not touched)",
    )
    parser.add_argument("shards", type=Path, help="directory with manifest.json")
    parser.set_defaults(handler=_run_upgrade_shards)


def _run_upgrade_shards(args: argparse.Namespace) -> int:
    from data_pipeline.shardset.legacy_table import upgrade_shard_set

    manifest = upgrade_shard_set(args.shards)
    print(f"{args.shards}: sample table {manifest.table} of {manifest.num_instances} instances; manifest format 2")
    return 0


def _add_validate_shards(commands) -> None:
    parser = commands.add_parser("validate-shards", help="decode and check every sample of a shard set")
    parser.add_argument("shards", help="directory or s3://BUCKET/PREFIX with manifest.json")
    parser.add_argument("--workers", type=int, default=2,
                        help="processes that check shards in parallel (on S3 each holds one tar in memory)")
    parser.set_defaults(handler=_run_validate_shards)


def _run_validate_shards(args: argparse.Namespace) -> int:
    from data_pipeline.ingest.validate import validate_shards

    checked, problems = validate_shards(args.shards, workers=args.workers)
    for problem in problems:
        print(f"PROBLEM {problem}")
    print(f"checked {checked} samples in {args.shards}: " + (f"{len(problems)} problem(s)" if problems else "all good"))
    return 1 if problems else 0
