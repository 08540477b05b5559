"""The README's Python API example, run as written: `trainer.train` in a plain Python process, no
launcher, on the demo's config."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.helpers.training import REPO

pytestmark = pytest.mark.integration

# Appended to the example's own overrides: one epoch of the tiny split (4 steps of 32 images), and the
# end-of-run kNN without the linear probe's sweep (the probe has its own tests; this one is about the API).
TINY = ["optim.epochs=1", "logging.progress=false", "eval.linear_at_end=false"]

PRELUDE = f"""
import json, os
import trainer

example_load = trainer.load_job_config
trainer.load_job_config = lambda path, overrides=None: example_load(path, [*(overrides or []), *{TINY!r}])
"""

# After the example: the variables of the one-process job are gone, and the same process trains again.
EPILOGUE = """
left = [name for name in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT") if name in os.environ]
again = trainer.train(config, resume="none")
print("AFTER " + json.dumps({"left": left, "first": [result.stopped_by, result.state.global_step],
                             "again": [again.stopped_by, again.state.global_step], "scores": result.scores}))
"""


def readme_example() -> str:
    """The first Python block of README.md's "Python API" section."""
    section = (REPO / "README.md").read_text().split("\n## Python API\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.integration
def test_the_readme_example_trains_the_demo_in_one_process_and_can_train_again(tiny_digits_split, tmp_path):
    """The example, exec'd unchanged in a fresh interpreter (no launcher's environment) in a
    directory laid out like the repository (configs/demo_cpu.yaml, out/demo/shards/), finishes its
    run and returns the final kNN scores; afterwards no torchrun variable is left in the
    environment and a second ``trainer.train`` in the same process trains again."""
    (tmp_path / "configs").mkdir()
    shutil.copy(REPO / "configs" / "demo_cpu.yaml", tmp_path / "configs")
    for split in ("train", "val"):
        shutil.copytree(tiny_digits_split[split], tmp_path / "out" / "demo" / "shards" / split)
    code = PRELUDE + readme_example() + textwrap.dedent(EPILOGUE)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-4000:]
    outcome = json.loads(done.stdout.split("AFTER ", 1)[1])
    assert outcome["first"] == ["finished", 4] and outcome["again"] == ["finished", 4], outcome
    assert outcome["left"] == [], outcome
    assert 0 <= outcome["scores"]["knn_trained"] <= 1, outcome
    assert (tmp_path / "out" / "demo" / "checkpoints" / "step_000000004").is_dir()
    assert "training as one process" in done.stderr
