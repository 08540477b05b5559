"""What a staged checkpoint save holds in host memory, counted from its plan."""

import torch

from trainer.checkpoint.save_plan import FileWrite, RowsWrite


def kept_bytes(plan) -> int:
    """Bytes of the distinct host buffers a staged save plan holds (what stays for the next save)."""
    storages = {}

    def visit(value):
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)

    for item in plan:
        visit(item.payload if isinstance(item, FileWrite) else item.tensors if isinstance(item, RowsWrite) else None)
    return sum(storages.values())
