"""What an objective keeps beside the backbone, described for the memory planner (``trainer.planning``)
without building the objective: no process group, no tensors, only its settings.

``ObjectiveConfig.memory_plan(views)`` returns one of these descriptions; the planner turns it into
bytes per rank for the job's N, ranks, global batch, D, dtype, device and backbone optimizer.  A new
objective returns the description of the state it keeps (any N-way cosine classifier over every
instance is ``ClassifierRows``, whatever its loss), or a new description with its arithmetic
registered in ``trainer.planning.objective_memory``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Union


class NoMemoryPlan(NotImplementedError):
    """The objective cannot describe its memory: ``instcls plan`` refuses to guess it."""


@dataclass(frozen=True)
class ClassifierRows:
    """``instance`` (One-Million-Way): W ``[N, D]`` fp32 with its gradient and SGD momentum, sharded by
    class range over the ranks (DHP) or replicated on each (the DDP baseline); per step the chunk
    workspace or the fused kernels' buffers, and what the settings below add.

    Attributes:
        sharded: DHP (True) or DDP (False).
        chunk_size: rows scored at once by the chunked path.
        logits_cache_bytes: the logits are kept for the backward when they fit in this budget.
        kernel: "auto", "chunked" or "fused" (``HeadSettings.kernel``).
        hard_negatives: K of top-K smoothing (0: off): its search table, and K + 1 target rows per sample.
        co2: CO2's consistency term rides in the chunk loop (its scratch block in the backward).
        update_in_backward: W's SGD runs inside the backward: its gradient never exists in full.
    """

    sharded: bool = True
    chunk_size: int = 65536
    logits_cache_bytes: int = 0
    kernel: str = "auto"
    hard_negatives: int = 0
    co2: bool = False
    update_in_backward: bool = False

    grows_with_instances: ClassVar[bool] = True  # the plan needs N

    @property
    def kind(self) -> str:
        return "dhp" if self.sharded else "ddp"


@dataclass(frozen=True)
class SampledRows:
    """``pic`` (PIC): W ``[N, D]`` sharded by class range, in a row store (on the device only for
    ``row_store: device``); each step fetches the rows of the batch's ids and the ``queue_size``
    recent ids (with their momentum, and a gradient for them) and scores only those.

    Attributes:
        queue_size: K recent ids scored besides the batch.
        row_store: "device", "host" or "disk".
        chunk_size, kernel, co2: as ``ClassifierRows``' (over the sampled rows).
        all_negatives: ``negatives: all``: every local row is fetched and scored each step.
    """

    kind: ClassVar[str] = "pic"
    grows_with_instances: ClassVar[bool] = True
    queue_size: int = 65536
    row_store: str = "host"
    chunk_size: int = 65536
    kernel: str = "auto"
    co2: bool = False
    all_negatives: bool = False


@dataclass(frozen=True)
class Prototypes:
    """``swav`` (SwAV): K prototypes ``[K, D]`` fp32 replicated on every rank, their gradient and the
    state of the optimizer that steps them (the backbone's); a queue of earlier global-crop features
    (``queue_length`` over all ranks, each rank its share, every global crop of a sample kept);
    per step every view's scores ``[b, K]``, the log-softmax each swapped pair saves for the
    backward, and Sinkhorn's working copies over the local batch plus the queue's share.

    Attributes:
        num_prototypes: K.
        queue_length: queued samples over all ranks (0: no queue).
        global_views: crops whose codes are computed (and queued).
        sinkhorn_dtype: "float32" or "float64": Sinkhorn's element size.
    """

    kind: ClassVar[str] = "swav"
    grows_with_instances: ClassVar[bool] = False  # nothing it keeps depends on N
    num_prototypes: int
    queue_length: int
    global_views: int
    sinkhorn_dtype: str = "float32"


@dataclass(frozen=True)
class QueuedKeys:
    """``moco`` (MoCo v2): a queue of ``queue_size`` fp32 keys ``[K, D]`` with their sample ids, split over
    the ranks like the classifier's rows and never trained (no gradient, no optimizer state); per step
    the gathered queries and keys, and the kernel's chunk workspace over the queue's share.  The teacher
    it reads its keys from is counted as every teacher is (``PlanInput.teacher``).

    Attributes:
        queue_size: K.
        chunk_size, kernel: as ``ClassifierRows``' (over the queue's slots).
        co2: CO2's term rides in the chunk loop: the keys are scored too, and its scratch block.
    """

    kind: ClassVar[str] = "moco"
    grows_with_instances: ClassVar[bool] = False  # the queue's size is its own setting
    queue_size: int = 65536
    chunk_size: int = 65536
    kernel: str = "auto"
    co2: bool = False


ObjectiveMemoryPlan = Union[ClassifierRows, SampledRows, Prototypes, QueuedKeys]
