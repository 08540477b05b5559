"""The fault drills of `instcls drill`, each on real 2-rank jobs, and a kill at every stage of a
checkpoint write.  A drill passes only when what the job left on disk says so (see
``trainer.drills.catalogue``); the kills must end bit-identical to a run never interrupted.

NaN has its own job test in test_training.py, a damaged checkpoint and pickled code theirs in the
unit tests, so those drills repeat here only in the slow run.  The job test of preemption (SIGTERM
to `instcls launch`, the retryable exit code, the same command resuming) is test_mlflow_tracking.py's,
and pods recreated and resuming to the uninterrupted state are test_pod_drills.py's, so the one-agent
SIGTERM drill runs in the slow run too.  A peer's preemption (SIGTERM to one rank; torchrun restarts the ranks in
place) runs only in the slow run: the launcher's side of it is unit-tested (test_exit_codes.py)."""

import json
import os
from pathlib import Path

import pytest

from trainer.drills.catalogue import DRILLS, NODE_DRILLS, killed_during_save

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("drill-context")]  # one worker builds its inputs

COVERED_ELSEWHERE = {"peer-preempted", "loss-becomes-nan", "nan-step-skipped", "damaged-newest-checkpoint",
                     "checkpoint-with-pickled-code",
                     "preempted-with-sigterm",  # test_mlflow_tracking.py's SIGTERM to `instcls launch`
                     # the exact resume: trainjob/replaced-pod; a killed rank: test_stop_agreement.py's
                     # SIGTERM to one rank; checkpoint writes cut short: the unit tests of the writer
                     "rank-killed-mid-step", "rank-killed-while-saving", "disk-full-during-save",
                     "metrics-port-taken",  # the drill command's test below runs it
                     # a damaged sample is named by shard and key: test_loaders.py
                     "shard-damaged-mid-run", "shard-damaged-skipped"}


@pytest.fixture
def context(drill_context):
    return drill_context


@pytest.mark.parametrize("name", [pytest.param(name, marks=[pytest.mark.slow] if name in COVERED_ELSEWHERE else [])
                                  for name in DRILLS if name not in NODE_DRILLS])  # test_two_nodes, test_pod_drills
def test_drill(context, name):
    result = DRILLS[name](context)
    assert result.passed, str(result)
    if name == "preempted-with-sigterm":  # three runs, a resume among them: nothing was compiled at run time
        # (DeepSpeed's CPU shared-memory op included): a build depends on the machine's compiler and
        # cache, and costs every new pod up to a minute.  conftest points TORCH_EXTENSIONS_DIR at an empty folder.
        extensions = Path(os.environ["TORCH_EXTENSIONS_DIR"])
        assert not any(extensions.rglob("*.so")), sorted(extensions.rglob("*"))
    if name != "shard-damaged-skipped":  # that one loses the unreadable samples, as it was told to
        assert result.data_lost.startswith("none"), result


def test_the_drill_command_prints_its_table(context, tmp_path, capsys):
    from trainer.cli import main

    out = tmp_path / "drills.json"
    assert main(["drill", "--only", "metrics-port-taken", "--work-dir", str(context.work_dir), "--json", str(out)]) == 0
    (result,) = json.loads(out.read_text())
    assert result["name"] == "metrics-port-taken" and result["passed"], result
    # The drill's row holds each of its fields (the one test of format_table's text).
    (row,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"| {result['name']} |")]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[:4] == [result["name"], result["fault"], result["outcome"], result["data_lost"]], cells
    assert result["recovery_s"] is None or cells[4] == f"{result['recovery_s']:.1f} s", cells


# (fail point, whether checkpoint 4 is complete when the kill comes); rank 0 alone renames and prunes
WRITE_STAGES = [
    pytest.param("checkpoint.before_rename,rank=0", False, id="manifest-written-not-renamed", marks=pytest.mark.slow),
    pytest.param("checkpoint.before_engine,rank=1", False, id="before-any-file", marks=pytest.mark.slow),
    pytest.param("checkpoint.after_components,rank=0", False, id="after-components", marks=pytest.mark.slow),
    pytest.param("checkpoint.after_rename,rank=0", True, id="renamed-not-pruned", marks=pytest.mark.slow),
]  # after the DeepSpeed files: the rank-killed-while-saving drill, in the default run


@pytest.mark.parametrize("fault, completes", WRITE_STAGES)
def test_a_kill_at_any_stage_of_a_save_never_leaves_a_half_checkpoint_taken_for_complete(
        context, tmp_path, fault, completes):
    result = killed_during_save(context, fault, completes, tmp_path / "run")
    assert result.passed, str(result)
    assert result.data_lost.startswith("none"), result
