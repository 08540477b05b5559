"""Small C++ kernels for CPU ranks, built on first use where inductor's code falls short.

``consistency_grad_kernel()`` writes CO2's per-chunk ``dL/dz`` over the chunk's logits in place
(``csrc/consistency_grad.cpp``; why inductor cannot is said there).  It is built with
``torch.utils.cpp_extension`` for the vector ISA inductor picks on this machine (AVX2, AVX-512, ...),
once per machine: ~30 s, cached under ``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``),
and a process that finds it built only loads it.  Without a C++ compiler or ninja it logs why once and
the caller keeps its portable path (inductor, else eager PyTorch): same numbers, slower.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "consistency_grad.cpp"


def _isa_flags() -> tuple[str, list[str]]:
    """(name, compiler flags) of the vector ISA inductor would use here; ("scalar", []) without one."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()
    if not isa:
        return "scalar", []
    macros = isa.build_macro()
    # ATen's vector headers pick their implementation from CPU_CAPABILITY_<NAME> and CPU_CAPABILITY.
    names = [macro.removeprefix("CPU_CAPABILITY_") for macro in macros if macro.startswith("CPU_CAPABILITY_")]
    flags = [*isa.build_arch_flags().split(), *(f"-D{macro}" for macro in macros)]
    if names:
        flags.append(f"-DCPU_CAPABILITY={names[0]}")
    return str(isa), flags


@functools.cache
def consistency_grad_kernel() -> Callable | None:
    """``consistency_grad_(logits, shift, factor, own, coefficients, ranks, views, global_views, power,
    ratio)``, or None where it cannot be built (logged once)."""
    try:
        from torch.utils.cpp_extension import load

        isa, flags = _isa_flags()
        module = load(name=f"instcls_consistency_grad_{isa}", sources=[str(SOURCE)], extra_cflags=["-O3", *flags])
        return module.consistency_grad_
    except Exception as error:  # noqa: BLE001 - no compiler, no ninja, a failed build: the portable path
        log.warning("could not build the CPU kernel of CO2's backward (%s: %s); using inductor's fused function "
                    "instead (same results, a slower backward)", type(error).__name__, str(error).splitlines()[0])
        return None
