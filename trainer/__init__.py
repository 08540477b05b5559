"""instcls trainer: backbone, sharded instance classifier, engine and tools."""

import os


def _name_deepspeed_accelerator() -> None:
    """DeepSpeed picks its accelerator when first imported and, finding no GPU, warns "Setting
    accelerator to CPU ..." on every CPU run.  Telling it (``DS_ACCELERATOR``, its documented switch)
    what its own probe would find is quiet; a value the user set is kept."""
    if "DS_ACCELERATOR" not in os.environ:
        import torch

        os.environ["DS_ACCELERATOR"] = "cuda" if torch.cuda.device_count() > 0 and torch.cuda.is_available() else "cpu"


_name_deepspeed_accelerator()
