"""The bench commands' options come from their settings dataclasses: names, types, choices,
defaults and help from the fields and the docstring, and the parsed options give back the settings."""

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from trainer.bench.checkpoint_bench import CheckpointBenchSettings
from trainer.bench.classifier_bench import ClassifierBenchSettings
from trainer.bench.data_bench import DataBenchSettings
from trainer.bench.ddp_vs_dhp import SweepSettings
from trainer.bench.exporter_bench import ExporterBenchSettings
from trainer.bench.pic_bench import PicBenchSettings
from trainer.cli import build_parser
from trainer.cli.settings_options import add_settings_options, field_docs, settings_from_args


@dataclass(frozen=True)
class Example:
    """Settings of a made-up benchmark.

    Attributes:
        count: how many, over
            two lines.
        rate, scale: shared by two fields.
        mode: one of two.
        where: a directory (default: a temporary one).
        names: comma-separated names.
        fast: skip the slow part.
    """

    count: int = 3
    rate: float = 0.5
    scale: float = 2.0
    mode: Literal["a", "b"] = "a"
    where: Path | None = None
    names: tuple[str, ...] = ("x", "y")
    fast: bool = False


def parse(settings_class, argv, **kwargs):
    parser = argparse.ArgumentParser()
    add_settings_options(parser, settings_class, **kwargs)
    return parser, parser.parse_args(argv)


def test_docstring_entries_span_continuation_lines_and_shared_names():
    docs = field_docs(Example)
    assert docs["count"] == "how many, over two lines."
    assert docs["rate"] == docs["scale"] == "shared by two fields."
    assert set(docs) == {"count", "rate", "scale", "mode", "where", "names", "fast"}


def test_defaults_round_trip_and_options_are_typed():
    _, args = parse(Example, [])
    assert settings_from_args(Example, args) == Example()
    _, args = parse(Example, ["--count", "7", "--rate", "1e-3", "--mode", "b", "--where", "d", "--names", "p,q,r",
                              "--fast"])
    assert settings_from_args(Example, args) == Example(7, 1e-3, 2.0, "b", Path("d"), ("p", "q", "r"), True)


def test_a_value_outside_the_literal_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse(Example, ["--mode", "c"])
    assert "invalid choice: 'c'" in capsys.readouterr().err


def test_help_shows_the_doc_and_the_default_unless_the_doc_names_it():
    parser, _ = parse(Example, [])
    text = " ".join(parser.format_help().split())
    assert "--count COUNT how many, over two lines (default 3)" in text
    assert "--where WHERE a directory (default: a temporary one)" in text  # no "(default None)"
    assert "--fast skip the slow part" in text


def test_skipped_fields_keep_their_defaults_and_computed_ones_are_taken():
    parser, args = parse(Example, ["--count", "5"], skip=("rate", "scale"))
    assert "--rate" not in parser.format_help()
    assert settings_from_args(Example, args, scale=4.0) == Example(count=5, scale=4.0)


def test_a_field_without_help_is_refused_naming_it():
    @dataclass
    class Undocumented:
        """Attributes:
        known: documented.
        """

        known: int = 1
        unknown: int = 2

    with pytest.raises(TypeError, match=r"Undocumented\.unknown has no help text.*Attributes:"):
        parse(Undocumented, [])


@pytest.mark.parametrize("settings_class", [ClassifierBenchSettings, DataBenchSettings, SweepSettings,
                                            ExporterBenchSettings, PicBenchSettings, CheckpointBenchSettings])
def test_every_bench_setting_is_documented(settings_class):
    assert parse(settings_class, [])[0] is not None


@pytest.mark.parametrize("argv, settings", [
    ("bench classifier --num-classes 10 --dtype bfloat16",
     ClassifierBenchSettings(num_classes=10, dtype="bfloat16")),
    ("bench pic --sizes 100,max --store host --store-dir /s", PicBenchSettings(sizes=("100", "max"), store="host",
                                                                               store_dir="/s")),
    ("bench data --shards d --multicrop 0", DataBenchSettings(shards="d", multicrop=0)),
    ("bench ddp-vs-dhp --logits-cache-gib 0.5 --backbone resnet18 --update-in-backward",
     SweepSettings(logits_cache_bytes=2**29, backbone="resnet18", update_in_backward=True)),
    ("bench exporter --arch resnet50 --seconds 2", ExporterBenchSettings(arch="resnet50", seconds=2.0)),
    ("bench checkpoint --datasets 6400 --job-ranks 32 --directory /c",
     CheckpointBenchSettings(datasets=("6400",), job_ranks=32, directory=Path("/c"))),
])
def test_each_bench_command_builds_its_settings(argv, settings, monkeypatch):
    built = []

    class Ran(Exception):
        """Stops the command at its run: what comes after reports a real run's results."""

    def run(settings, *args, **kwargs):
        built.append(settings)
        raise Ran

    bench = argv.split()[1].replace("-", "_")  # the bench's module, which runs it (its settings' module is torch-free)
    monkeypatch.setattr(f"trainer.bench.{bench if bench == 'ddp_vs_dhp' else bench + '_bench'}.run", run)
    args = build_parser().parse_args(argv.split())
    with pytest.raises(Ran):
        args.handler(args)
    assert built == [settings]
