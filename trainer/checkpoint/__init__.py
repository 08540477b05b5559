"""Checkpoints: what a save writes (in the background), how a resume reads it back on any number
of ranks, and the files' safety checks.

The entry points: ``AsyncCheckpointer`` (the trainer's saves), ``save_checkpoint`` (one blocking
save) and ``load_checkpoint`` (a resume into this run's layout), over a mapping of named entries
(``Stateful`` components, ``DirectoryState`` entries such as the DeepSpeed engine, ``FieldsState``).
``components`` plans and loads the entries; ``async_checkpoint`` writes a plan in the background
and commits it; the other modules are their parts.
"""

from trainer.checkpoint.async_checkpoint import AsyncCheckpointer, save_checkpoint
from trainer.checkpoint.components import DirectoryState, FieldsState, Stateful, load_checkpoint

__all__ = ["AsyncCheckpointer", "DirectoryState", "FieldsState", "Stateful", "load_checkpoint", "save_checkpoint"]
