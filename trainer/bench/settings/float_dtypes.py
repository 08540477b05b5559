"""The element types a benchmark's or a plan's classifier step runs in, named as torch names them
(``getattr(torch, name)``), without importing torch."""

from typing import Literal, get_args

FloatDtype = Literal["float32", "bfloat16", "float16"]  # what torch runs a step in on CPUs and GPUs alike
FLOAT_DTYPES: tuple[str, ...] = get_args(FloatDtype)
