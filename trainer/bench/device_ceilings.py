"""The two ceilings of this device, measured in this process: the matmul rate and memory bandwidth.

A roofline for any kernel is the larger of its FLOPs over the matmul rate and its bytes over the
bandwidth.  Datasheet figures are leads; these are what this device, at its present clocks, does:
a large ``torch.mm`` of random operands (never zeros: they run faster), and a large device-to-device
copy counting bytes read plus bytes written.  Each is the median of several timed runs after a warm-up.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Ceilings:
    device: str
    matmul_tflops: dict  # dtype name -> TFLOP/s of an n x n x n torch.mm
    copy_gb_per_s: float  # bytes read + written per second by a device-to-device copy

    def as_dict(self) -> dict:
        return asdict(self)


def _median_seconds(run, device: torch.device, repeats: int) -> float:
    run()  # warm-up: handles, kernels, allocation
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            run()
            times.append(time.perf_counter() - began)
    return sorted(times)[len(times) // 2]


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 10) -> float:
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    out = torch.empty(n, n, device=device, dtype=dtype)
    return 2 * n**3 / _median_seconds(lambda: torch.mm(a, b, out=out), device, repeats) / 1e12


def copy_gb_per_s(device: torch.device, nbytes: int, repeats: int = 10) -> float:
    source = torch.randn(nbytes // 4, device=device)
    target = torch.empty_like(source)
    return 2 * source.numel() * 4 / _median_seconds(lambda: target.copy_(source), device, repeats) / 1e9


def measure(device: torch.device) -> Ceilings:
    """Sizes that fill a GPU and stay well past its cache (8192^3 products, 4 GiB copies), or a CPU
    core's share of them."""
    big = device.type == "cuda"
    n, nbytes = (8192, 4 << 30) if big else (1024, 256 << 20)
    dtypes = (torch.bfloat16, torch.float32) if big else (torch.float32,)
    return Ceilings(device=torch.cuda.get_device_name(device) if big else "cpu",
                    matmul_tflops={str(d).removeprefix("torch."): matmul_tflops(device, d, n) for d in dtypes},
                    copy_gb_per_s=copy_gb_per_s(device, nbytes))


if __name__ == "__main__":
    import json

    print(json.dumps(measure(torch.device("cuda" if torch.cuda.is_available() else "cpu")).as_dict()))
