"""How many ops a piece of code dispatches: the CPU-measurable stand-in for kernel-launch overhead.

``OpCounter`` is a ``TorchDispatchMode``: every op that reaches the dispatcher below autograd while
it is active is counted once, by name.  What that means:

- a composite op is counted as what it decomposes into (``linear`` is ``t`` + ``addmm``), the
  ops a backend receives; view and metadata ops (``t``, ``view``, ``detach``) count like any other;
- a foreach or fused op (``_foreach_add_`` over 60 tensors, ``_fused_sgd_``) counts once, as it
  launches one kernel per tensor chunk rather than one per tensor: the difference this counter
  exists to show;
- ops an op runs inside its own implementation are not seen (the mode is off while its call runs);
- the backward's ops are dispatched by the autograd engine, on the thread that runs it (the mode's
  state travels with the engine's tasks), so the mode must be active around ``.backward()``;
- collectives are ops too (``c10d.allreduce_``, DeepSpeed's and DDP's reducer's alike);
- the profiler's annotations (``profiler._record_function_*``, which every torch optimizer step
  opens) launch nothing and are not counted.
"""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

_NOT_COUNTED_NAMESPACES = ("profiler",)


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as ops: ...`` then ``ops.total`` and ``ops.by_op`` (name -> count);
    ``take()`` hands over what was counted since the last ``take()`` (per-phase counts)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: Counter[str] = Counter()
        self._since_take: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def take(self) -> Counter[str]:
        """The ops counted since the previous ``take()`` (or the start), by name."""
        taken, self._since_take = self._since_take, Counter()
        return taken

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if not name.startswith(_NOT_COUNTED_NAMESPACES):
            self.by_op[name] += 1
            self._since_take[name] += 1
        return func(*args, **(kwargs or {}))
