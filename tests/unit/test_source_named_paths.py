"""Every repository path that the code's docstrings, comments and messages name exists, so a reader
sent to ``scripts/...`` or ``docs/...`` finds the file: a script renamed or moved must fail here.

Read: the Python files under trainer/, data_pipeline/ and scripts/; a path is a word that starts with
one of the repository's own folders (``scripts/gpu_check.sh``, ``docs/testing.md`` before its
``#anchor``).  A path that an f-string, a pattern or a placeholder completes
(``ds_configs/zero{stage}_bf16.json``, ``configs/*.yaml``, ``k8s/overlays/OVERLAY``) is not one file and
is left out."""

from __future__ import annotations

import re

from tests.helpers.training import REPO

SCANNED = ("trainer", "data_pipeline", "scripts")
FOLDERS = ("scripts", "trainer", "tests", "docs", "configs", "ds_configs", "k8s", "data_pipeline")
PATH = re.compile(rf"(?<![\w/.-])((?:{'|'.join(FOLDERS)})/[\w./-]*\w)(?![\w{{*<])")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")  # OVERLAY, NAME: the reader's choice


def named_paths(text: str) -> list[str]:
    return [path for path in PATH.findall(text) if not any(PLACEHOLDER.match(part) for part in path.split("/"))]


def test_every_path_the_code_names_exists():
    missing = [f"{path.relative_to(REPO)} names {named}"
               for folder in SCANNED for path in sorted((REPO / folder).rglob("*.py"))
               for named in named_paths(path.read_text()) if not (REPO / named).exists()]
    assert missing == []


def test_the_scan_finds_a_named_script_and_leaves_templates_out():
    text = ('"""a check (``scripts/gpu_sync_batch_norm_check.py``), see docs/testing.md#tiers.\n'
            'f"as in ds_configs/zero{stage}_bf16.json", configs/*.yaml, k8s/overlays/OVERLAY, other_scripts/x.py"""')
    assert named_paths(text) == ["scripts/gpu_sync_batch_norm_check.py", "docs/testing.md"]
