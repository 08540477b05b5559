"""DeepSpeed is imported in one module only, which names its accelerator first."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.training import REPO

THE_ONE_MODULE = Path("trainer/parallel/deepspeed_import.py")
SCANNED = ("trainer", "data_pipeline", "ds_configs", "tests", "scripts")


def deepspeed_imports(root: Path = REPO) -> list[str]:
    """``path:line`` of every ``import deepspeed...`` / ``from deepspeed... import`` outside the one module."""
    found = []
    for folder in SCANNED:
        for path in sorted((root / folder).rglob("*.py")):
            if path.relative_to(root) == THE_ONE_MODULE:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
                if any(name == "deepspeed" or name.startswith("deepspeed.") for name in names):
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_every_deepspeed_import_goes_through_the_one_module():
    """DeepSpeed reads DS_ACCELERATOR when first imported: an import elsewhere could come first and
    make it probe (and warn) on its own.  Take deepspeed, or the part of it needed, from
    trainer.parallel.deepspeed_import."""
    assert deepspeed_imports() == []


def test_a_planted_direct_import_is_named(tmp_path):
    """The scan finds both forms, lazy ones inside functions included."""
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "sneaky.py").write_text("def f():\n    from deepspeed.utils import groups\n"
                                                    "import deepspeed.comm as comm\n")
    assert sorted(deepspeed_imports(tmp_path)) == ["trainer/sneaky.py:2", "trainer/sneaky.py:3"]


def test_the_accelerator_is_the_cpu_without_cuda_devices_and_a_users_choice_is_kept():
    """What DeepSpeed's own probe would pick (the suite hides GPUs: "cpu"), unless DS_ACCELERATOR is set."""
    from trainer.parallel.deepspeed_import import name_deepspeed_accelerator

    environ = {}
    assert name_deepspeed_accelerator(environ) == "cpu" and environ == {"DS_ACCELERATOR": "cpu"}
    environ = {"DS_ACCELERATOR": "xpu"}
    assert name_deepspeed_accelerator(environ) == "xpu" and environ == {"DS_ACCELERATOR": "xpu"}


def test_deepspeed_is_imported_without_mlflow_which_a_later_import_still_loads():
    """DeepSpeed's autotuner imports MLflow (over a second) when DeepSpeed loads; every rank pays it
    unless the import hides MLflow, and a tracking sink opened afterwards must get the real module."""
    probe = ("import sys\n"
             "import trainer.parallel.deepspeed_import\n"
             "import deepspeed.autotuning.autotuner as autotuner\n"
             "print('mlflow' in sys.modules, autotuner.has_mlflow)\n"
             "import mlflow\n"
             "print(hasattr(mlflow, 'start_run'))\n")
    run = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["False", "False", "True"]


def test_a_hidden_module_that_is_already_loaded_stays_loaded():
    from trainer.parallel.deepspeed_import import hidden_module

    with hidden_module("json"):
        import json
    assert json.dumps([1]) == "[1]" and sys.modules["json"] is json
    with hidden_module("instcls_no_such_module"), pytest.raises(ImportError):
        import instcls_no_such_module  # noqa: F401
    assert "instcls_no_such_module" not in sys.modules
