"""The command line answers at once: building its parser (`instcls --help`, `--version`, every
command's `--help`) imports no torch, torchvision, faiss, DeepSpeed or DALI; handlers import what
they need.  The choices it offers are written out in torch-free modules, equal to the registries."""

from __future__ import annotations

import json
import subprocess
import sys

from trainer.bench.settings.classifier import ClassifierBenchSettings
from trainer.cli import main
from trainer.cli.plan_choices import BACKBONE_NAMES, OPTIMIZER_NAMES
from trainer.drills.drill_names import drill_names

# Run in a fresh interpreter (this one has loaded torch through other tests): builds the parser,
# lists every command path from it (subcommands at any depth, and each choice of a positional such
# as `eval knn`), then runs `--version` and each path's `--help` in turn, noting the first after
# which a heavy module is loaded.
HELP_OF_EVERY_COMMAND = r"""
import argparse, contextlib, io, json, sys

from trainer.cli import build_parser, main

HEAVY = ("torch", "torchvision", "faiss", "deepspeed", "nvidia.dali")


def heavy_modules():
    return sorted(m for m in sys.modules if any(m == name or m.startswith(name + ".") for name in HEAVY))


def command_paths(parser, prefix):
    yield prefix
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, subparser in action.choices.items():
                yield from command_paths(subparser, [*prefix, name])
        elif not action.option_strings and action.choices:
            for choice in action.choices:
                yield [*prefix, choice]


parser = build_parser()
report = {"after_build": heavy_modules(), "ran": [], "first_heavy": None}
for argv in [["--version"], *([*path, "--help"] for path in command_paths(parser, []))]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = main(argv)
        except SystemExit as exit:
            code = exit.code
    report["ran"].append({"argv": argv, "code": code, "output": out.getvalue()[:200]})
    if heavy_modules():
        report["first_heavy"] = {"argv": argv, "modules": heavy_modules()[:5]}
        break
print(json.dumps(report))
"""


def test_help_and_version_of_every_command_import_no_torch():
    done = subprocess.run([sys.executable, "-c", HELP_OF_EVERY_COMMAND], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["after_build"] == [], "building the parser imports these: move the import into the handler"
    assert report["first_heavy"] is None, f"`instcls {' '.join(report['first_heavy']['argv'])}` imports " \
        f"{report['first_heavy']['modules']}: the command's register() must not import them"
    ran = {" ".join(run["argv"]): run for run in report["ran"]}
    # The walk reaches nested commands and positional choices, and the bench added here.
    assert {"--version", "--help", "bench classifier --help", "bench cli --help", "eval knn --help",
            "eval linear --help", "plan --help", "make-shards --help", "drill --help"} <= set(ran)
    assert len(ran) > 25
    assert all(run["code"] == 0 for run in ran.values()), [argv for argv, run in ran.items() if run["code"] != 0]
    assert all(run["output"].startswith("usage: instcls") for argv, run in ran.items() if argv != "--version")
    assert ran["--version"]["output"].startswith("instcls ")


def test_the_choices_written_out_for_the_parser_are_the_registries_entries():
    """`plan --backbone`/`--optimizer` and `drill --only` offer names from torch-free lists; a backbone,
    optimizer or drill registered without its name there would not be offered."""
    from trainer.drills.catalogue import DRILLS
    from trainer.models import backbone_names
    from trainer.optim import optimizer_names

    assert BACKBONE_NAMES == backbone_names(), "add the new backbone's name to trainer/cli/plan_choices.py"
    assert list(OPTIMIZER_NAMES) == optimizer_names(), "add the new optimizer's name to trainer/cli/plan_choices.py"
    assert drill_names() == tuple(DRILLS), "add the new drill's name to trainer/drills/drill_names.py"


def test_the_classifier_bench_chooses_its_chunk_size_when_it_runs_not_when_the_parser_is_built():
    """The default chunk depends on a GPU, which only torch can tell: left unset in the settings the
    parser builds, and filled in by the run (the suite hides GPUs: 2048, the CPU chunk)."""
    assert ClassifierBenchSettings().chunk_size is None
    assert ClassifierBenchSettings().on_this_machine().chunk_size == 2048
    assert ClassifierBenchSettings(chunk_size=512).on_this_machine().chunk_size == 512


def test_bench_cli_times_the_help_beside_torchs_import_and_prints_the_ratio(tmp_path, capsys):
    out = tmp_path / "cli.json"
    assert main(["bench", "cli", "--repeats", "1", "--warmup", "0", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    summary = json.loads(out.read_text())
    medians = summary["median_s"]
    assert set(medians) == {"instcls --help", 'python -c "import torch"', "python -c pass"}
    assert all(seconds > 0 for seconds in medians.values())
    assert summary["torch_over_help"] == medians['python -c "import torch"'] / medians["instcls --help"]
    assert lines[0].startswith("each command in a fresh process: median of 1 runs after 0 warm-up")
    for name, seconds in medians.items():  # one line per command with its median, as measured
        assert any(line.startswith(name) and f"{seconds:.3f}" in line for line in lines[2:5]), name
    assert lines[-1] == f"`import torch` alone takes {summary['torch_over_help']:.1f}x as long as `instcls --help`"
