"""What an objective asks of the trainer when it needs a teacher: a momentum copy of the backbone and head.

An objective's config returns a ``TeacherRequest`` from ``ObjectiveConfig.teacher_request(views)``
(None, the default: no teacher).  The trainer then keeps an fp32 copy of the network
(``trainer.engine.momentum_teacher``), runs it without gradient on the views the request names, hands
the objective its head features in ``StepViews.teacher``, and after every optimizer step that was
taken moves it towards the student: ``teacher = m * teacher + (1 - m) * student``, with ``m`` from the
request's schedule.  The request is read from the config alone, so ``instcls plan`` and the dry run
count the teacher without building anything.

Schedules (step ``k`` of ``K`` optimizer steps, 0-based):

- ``constant``: ``m`` at every step (MoCo: 0.999);
- ``cosine``: ``1 - (1 - m) * (cos(pi * k / K) + 1) / 2``, from ``m`` at the first step up to 1 at the
  end (BYOL's Section 3.2; DINO's teacher schedule is the same curve, per iteration).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True)
class TeacherRequest:
    """Attributes:
    views: positions, among the job's views (``ObjectiveContext.views``), of the views the teacher
        encodes; their features arrive in ``StepViews.teacher`` in this order.
    momentum: the base momentum ``m`` in [0, 1] (1 keeps the initial copy; 0 copies the student).
    schedule: "constant" or "cosine" (up to 1 at the last step), see the module docstring.
    sync_batch_norm: the teacher's BatchNorm layers normalise over the data-parallel group's whole
        batch (``trainer.parallel.sync_batch_norm``), whatever ``model.batch_norm`` makes of the
        student's; False: the teacher's layers are as the student's.
    field: the config field ``momentum`` comes from, named when it is refused (e.g.
        ``objective.momentum``).
    """

    views: tuple[int, ...]
    momentum: float
    schedule: str = "constant"
    sync_batch_norm: bool = False
    field: str = "objective.momentum"

    def __post_init__(self) -> None:
        object.__setattr__(self, "views", tuple(self.views))
        if not isinstance(self.momentum, (int, float)) or isinstance(self.momentum, bool) \
                or not 0.0 <= self.momentum <= 1.0:
            raise ValueError(f"{self.field}={self.momentum!r} is invalid: the teacher's momentum must be a number in "
                             "[0, 1] (MoCo: 0.999; 1 never moves the teacher, 0 copies the student every step)")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"the teacher's momentum schedule {self.schedule!r} (for {self.field}) is invalid: use "
                             f"one of {', '.join(SCHEDULES)}")
        if not self.views or len(set(self.views)) != len(self.views) \
                or any(not isinstance(v, int) or v < 0 for v in self.views):
            raise ValueError(f"the teacher's views {self.views} (for {self.field}) are invalid: name one or more "
                             "distinct view positions (0 is the first global view)")

    def check_views(self, num_views: int) -> None:
        """Refuses views the job's layout does not have (``num_views`` views a sample)."""
        missing = [v for v in self.views if v >= num_views]
        if missing:
            raise ValueError(f"the teacher of {self.field.rsplit('.', 1)[0]} encodes views {list(self.views)}, but "
                             f"the job's loader makes {num_views} views a sample (positions 0 to {num_views - 1}): "
                             "raise data.loader.augment.num_views (or small_crops), or ask for fewer views")

    def momentum_at(self, step: int, total_steps: int) -> float:
        """``m`` of the update after optimizer step ``step`` (0-based) of ``total_steps``."""
        if self.schedule == "constant":
            return float(self.momentum)
        progress = min(max(step, 0), total_steps) / max(total_steps, 1)
        return 1.0 - (1.0 - self.momentum) * (math.cos(math.pi * progress) + 1.0) / 2.0
