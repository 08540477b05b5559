"""`make image-check` end to end: the Dockerfile built (Docker, or buildah on a base made with
mmdebstrap) and run as the Kubernetes pod runs it.  It downloads about 6 GB and takes about
15 minutes, so it is `slow` (`make test-all`); it needs a Docker daemon or root, else it skips
saying so."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.image.engines import unavailable_reason

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(3600)
def test_the_image_builds_and_runs_the_pods_job():
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    result = subprocess.run([sys.executable, "-m", "scripts.image.check"], cwd=ROOT, capture_output=True, text=True,
                            timeout=3500)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    report = result.stdout[result.stdout.index("\nimage "):]
    for step in ("instcls --version", "image contents", "instcls selftest", "instcls plan", "make-shards train",
                 "train 1 epoch", "resume for epoch 2", "instcls eval knn", "read-only root file system"):
        assert re.search(rf"(?m)^  ok +\d+ s  {re.escape(step)}", report), f"{step} not passed:\n{report}"
    assert "make image-check: passed" in result.stdout
