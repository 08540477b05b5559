"""CPU ranks keep freed heap blocks (glibc's mallopt); other devices are left alone."""

import ctypes.util
import platform

import pytest
import torch

from trainer.parallel.host_memory import keep_freed_host_memory


def test_only_cpu_ranks_change_the_allocator():
    assert keep_freed_host_memory(torch.device("meta")) is False


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc" or ctypes.util.find_library("c") is None,
                    reason="mallopt is glibc's")
def test_glibc_accepts_the_thresholds():
    assert keep_freed_host_memory(torch.device("cpu")) is True
