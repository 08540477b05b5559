"""Work that only rank 0 does (the linear probe's fits at the end of a run, the resume check's
checksums at its start) may outlast any collective timeout: the other ranks wait for its result
without a deadline, and get it, or rank 0's failure.  2 gloo ranks whose control group (gloo beside
NCCL on GPUs) gives up after 3 s, while rank 0's work takes 6 s."""

from __future__ import annotations

import dataclasses
import datetime
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from trainer.parallel import ParallelDims, init_distributed
from trainer.parallel.launch import spawn_local_workers
from trainer.parallel.rank0_work import Rank0WorkFailed, run_on_rank0

pytestmark = pytest.mark.integration

CONTROL_TIMEOUT_S = 3
PROBE_S = 6


def _dims_with_a_short_control_timeout() -> ParallelDims:
    """The job's layout, its control group a gloo group that gives up after ``CONTROL_TIMEOUT_S``
    (the job itself starts with a longer one: ranks of a loaded machine start seconds apart)."""
    dims = init_distributed(timeout_s=60)
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=CONTROL_TIMEOUT_S))
    return dataclasses.replace(dims, control_group=control)


def _slow_curve(*inputs, seed: int = 0) -> dict:
    time.sleep(PROBE_S)
    return {1.0: 0.75}


def _final_scores() -> None:
    from trainer.eval_config import LinearProbeSection
    from trainer.evaluation import linear_protocol  # here: the other test's ranks need not import it
    from trainer.evaluation.features import LocalFeatures

    dims = _dims_with_a_short_control_timeout()
    rows = LocalFeatures(torch.zeros(2, 3), torch.tensor([0, 1]), torch.tensor([0, 1]))
    # scikit-learn's probe: rank 0 alone holds the gathered rows, and its fit outlasts the control timeout
    with (mock.patch.object(linear_protocol, "gather_to_rank0_host", lambda local, dims: local if dims.rank == 0
                            else None),
          mock.patch.object(linear_protocol, "linear_probe_curve", _slow_curve)):
        started = time.monotonic()
        results = linear_protocol.linear_scores(rows, rows, 2, LinearProbeSection(method="sklearn"), dims, curve=True)
        waited = time.monotonic() - started
    assert results == {"method": "sklearn", "top1": 0.75, "curve": {"1.0": 0.75}}, results
    assert waited > CONTROL_TIMEOUT_S + 1, waited  # every rank outlasted the control group's timeout


def _failing_work() -> None:
    dims = _dims_with_a_short_control_timeout()

    def probe():
        raise ValueError("the probe did not converge")

    expected = ValueError if dims.rank == 0 else Rank0WorkFailed
    with pytest.raises(expected, match="the probe did not converge"):
        run_on_rank0(probe, dims.control_group)
    # the next calls pair up on every rank, whatever came before, on any group
    assert run_on_rank0(lambda: dims.rank + 7, dims.control_group) == 7
    assert run_on_rank0(lambda: dims.rank + 8, dist.group.WORLD) == 8


def _resume_check(directory: str) -> None:
    from trainer.checkpoint import checkpoint_files

    dims = _dims_with_a_short_control_timeout()
    checksum = checkpoint_files.checkpoint_damage

    def slow_checksum(path):
        time.sleep(PROBE_S)
        return checksum(path)

    with mock.patch.object(checkpoint_files, "checkpoint_damage", slow_checksum):
        found = checkpoint_files.resolve_resume_on_rank0("auto", Path(directory), dims)
    assert found == Path(directory) / "step_000000004", found


def test_the_other_ranks_wait_past_the_control_timeout_for_rank0s_probe_and_get_its_result():
    spawn_local_workers(_final_scores, 2)


def test_a_failure_of_rank0s_work_is_raised_on_every_rank():
    spawn_local_workers(_failing_work, 2)


@pytest.mark.slow  # the same store wait as the probe test above, at the resume check
def test_the_other_ranks_wait_past_the_control_timeout_for_rank0s_resume_check(tmp_path):
    """Rank 0 checksums the newest checkpoint's files (minutes at ImageNet-21K) before any rank resumes."""
    (tmp_path / "step_000000004").mkdir()
    (tmp_path / "step_000000004" / "trainer.json").write_text("{}")  # complete; no manifest: nothing to checksum
    spawn_local_workers(_resume_check, 2, str(tmp_path))
