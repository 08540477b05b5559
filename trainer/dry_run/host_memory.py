"""Host memory stays real in the dry run: only the devices are fake.

The step's host-side code reads host tensors as NumPy arrays (PIC's row store and its step
stamps, sampler ids); a fake tensor has no values to give.  ``RealHostMemory`` runs every op whose
inputs are all real host tensors and whose output stays on the host with the fake modes off, so
the result is a real host tensor (pinned memory is marked, not pinned: that needs a driver).  An
op that involves a device gets its real inputs as fake copies of them (a write into a real host
tensor from the device then lands in the copy: the dry run needs no values).  A host tensor created larger than
``largest_real_bytes`` stays fake (a replicated classifier's initial rows at 30M classes would
need 15 GB of this machine's memory): code that reads its values on the host then stops the dry
run, naming the line.
"""

from __future__ import annotations

import math

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from trainer.dry_run.host_syncs import PINNED

LARGEST_REAL_BYTES = 1 << 30


def _created_bytes(args, kwargs) -> int:
    """Bytes a factory op (``empty``, ``zeros``, ``randn``...) asks for; 0 for other ops."""
    size = args[0] if args and isinstance(args[0], (list, tuple)) else None
    if size is None or not all(isinstance(n, int) for n in size):
        return 0
    dtype = kwargs.get("dtype") or torch.get_default_dtype()
    return math.prod(size) * torch.empty((), dtype=dtype, device="meta").element_size()


class RealHostMemory(TorchDispatchMode):
    def __init__(self, fake_mode, largest_real_bytes: int = LARGEST_REAL_BYTES) -> None:
        super().__init__()
        self.fake_mode, self.largest_real_bytes = fake_mode, largest_real_bytes

    def _fake(self, value):
        if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
            fake = self.fake_mode.from_tensor(value)
            if getattr(value, PINNED, False):
                setattr(fake, PINNED, True)
            return fake
        return value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        target = kwargs.get("device")
        stays_on_host = target is None or torch.device(target).type == "cpu"
        if (stays_on_host and all(not isinstance(t, FakeTensor) and t.device.type == "cpu" for t in tensors)
                and _created_bytes(args, kwargs) <= self.largest_real_bytes):
            pinned = kwargs.pop("pin_memory", False)
            with _disable_current_modes():
                out = func(*args, **kwargs)
            if pinned:
                setattr(out, PINNED, True)
            return out
        return func(*tree_map(self._fake, args), **tree_map(self._fake, kwargs))
