"""`make test` runs in pytest-xdist workers with `--dist loadgroup`: tests that share an expensive
module or session fixture (one bench run, the drills' inputs) carry one ``xdist_group`` so that one
worker builds it once.  A pytest that xdist cannot group (pytest 9 renamed the node id attribute
that xdist 3.8 suffixes with the group) would silently build it once per worker instead."""

import subprocess
import sys

GROUPED = '''
import os
import pytest

pytestmark = pytest.mark.xdist_group("shared")
LOG = os.path.join(os.path.dirname(__file__), "events.txt")


def record(line):
    with open(LOG, "a") as log:
        log.write(line + "\\n")


@pytest.fixture(scope="module")
def shared():
    record("BUILT")


@pytest.mark.parametrize("case", range(4))
def test_reads_the_shared_fixture(shared, case):
    record("RAN " + os.environ["PYTEST_XDIST_WORKER"])


@pytest.mark.xdist_group("other")
@pytest.mark.parametrize("case", range(4))
def test_ungrouped_work_beside_it(case):
    pass
'''


def test_a_group_runs_on_one_worker_and_builds_its_fixture_once(tmp_path):
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup",
                             "-p", "no:cacheprovider", str(tmp_path / "test_grouped.py")],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = (tmp_path / "events.txt").read_text().splitlines()
    workers = {line.split()[1] for line in lines if line.startswith("RAN")}
    assert len([line for line in lines if line.startswith("RAN")]) == 4
    assert len(workers) == 1, workers
    assert len([line for line in lines if line.startswith("BUILT")]) == 1
