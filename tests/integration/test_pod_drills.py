"""Each multi-node overlay's own pods (``trainer.drills.pods``: the rendered manifest's command,
environment and controller policy, two nodes on this machine) survive a replaced pod, a preemption,
a deleted pod and, on the elastic overlays, a node lost for good and its return: the job finishes
with exit 0 from the last complete checkpoint and trains what the uninterrupted run trained.

The default run holds the TrainJob's replaced pod (its runtime once could not take one back) and
the Indexed Job's preemption; every other overlay drill runs in the slow tier and in `make drill`."""

import pytest

from trainer.drills.catalogue import DRILLS, NODE_DRILLS

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("drill-context")]  # one worker builds its inputs

# the default run: the pods of one overlay; a preemption (SIGTERM to `instcls launch`, 143, the resume) is
# test_mlflow_tracking.py's, and the other overlays' drills run in `make test-all`
IN_DEFAULT_RUN = {"trainjob/replaced-pod"}


@pytest.mark.parametrize("name", [pytest.param(name, marks=[] if name in IN_DEFAULT_RUN else [pytest.mark.slow])
                                  for name in NODE_DRILLS if "/" in name])
def test_overlay_drill(drill_context, name):
    result = DRILLS[name](drill_context)
    assert result.passed, str(result)
    assert result.data_lost.startswith("none"), result
