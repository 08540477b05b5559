"""The classifier roofline's counts (trainer/bench/classifier_roofline.py) and its choice of bound."""

from __future__ import annotations

import pytest

from trainer.bench.classifier_roofline import bytes_moved, roofline

S, R, D = 8192, 221_830, 128  # ImageNet-21K on 64 ranks: one rank's rows, the gathered views


def test_the_fused_path_moves_no_logits_and_the_chunked_one_moves_them_several_times():
    fused = bytes_moved("fused/recompute", S, R, D, element=2)
    chunked = bytes_moved("chunked/recompute", S, R, D, element=2)
    assert chunked > 46 * S * R  # 16 bytes per logit forward, 30 backward
    assert fused < 0.02 * chunked  # W-sized traffic only


def test_the_bound_is_the_largest_term_with_its_counts():
    floor = roofline("fused/recompute", S, R, D, 2, matmul_gflops=800_000.0, copy_gb_per_s=4_000.0,
                     exp2_per_s=4.2e12)
    assert floor["flops"] == 10 * S * R * D and floor["exp2"] == 3 * S * R
    assert floor["matmul_s"] == pytest.approx(10 * S * R * D / 8e14)
    assert floor["seconds"] == max(floor["matmul_s"], floor["memory_s"], floor["exp2_s"])
    assert floor["bound"] == "matmul"
    chunked = roofline("chunked/recompute", S, R, D, 2, 800_000.0, 4_000.0, None)
    assert chunked["bound"] == "memory" and chunked["exp2_s"] == 0.0  # exp2 not modelled without a GPU
