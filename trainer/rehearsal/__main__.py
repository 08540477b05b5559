"""`python -m trainer.rehearsal`: run the rehearsal's stages, print and write the report."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from trainer.rehearsal.processes import StageFailed
from trainer.rehearsal.settings import DEFAULT_CONFIG, IMAGENET_1K_TRAIN_IMAGES, RehearsalSettings


def parse(argv: list[str]) -> tuple[RehearsalSettings, bool]:
    parser = argparse.ArgumentParser(prog="python -m trainer.rehearsal", description=__doc__)
    parser.add_argument("--work-dir", type=Path, default=Path("out/rehearsal"))
    parser.add_argument("--images", type=int, default=IMAGENET_1K_TRAIN_IMAGES,
                        help="N: synthetic training images, one classifier row each (default ImageNet-1K's)")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--ingest-parts", type=int, default=2, help="make-shards --part I/K processes side by side")
    parser.add_argument("--steps", type=int, default=300, help="training steps on 2 nodes")
    parser.add_argument("--checkpoint-step", type=int, default=200, help="the asynchronous save that is timed")
    parser.add_argument("--batch-per-rank", type=int, default=48, help="images per rank on 2 nodes")
    parser.add_argument("--resume-ranks", type=int, default=3)
    parser.add_argument("--resume-steps", type=int, default=10)
    parser.add_argument("--no-prior", action="store_true",
                        help="skip the contrastive prior's pass over all N images (W starts from Gaussian rows)")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--fresh", action="store_true", help="remove an earlier rehearsal's files first")
    args = parser.parse_args(argv)
    try:
        settings = RehearsalSettings(
            work_dir=args.work_dir.resolve(), images=args.images, image_size=args.image_size,
            ingest_parts=args.ingest_parts, steps=args.steps, checkpoint_step=args.checkpoint_step,
            batch_per_rank=args.batch_per_rank, resume_ranks=args.resume_ranks, resume_steps=args.resume_steps,
            contrastive_prior=not args.no_prior, config=args.config.resolve())
    except ValueError as error:
        parser.error(str(error))
    return settings, args.fresh


def main(argv: list[str]) -> int:
    from trainer.rehearsal.report import write_report
    from trainer.rehearsal.stages import clear, run_stages

    settings, fresh = parse(argv)
    if fresh:
        clear(settings)
    settings.work_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        results = run_stages(settings, say=lambda line: print(line, flush=True))
    except StageFailed as error:
        print(f"[rehearsal] {error}", file=sys.stderr)
        return 1
    print(write_report(settings, results))
    print(f"[rehearsal] {time.perf_counter() - started:.0f} s; report: {settings.work_dir / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
