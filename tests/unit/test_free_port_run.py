"""Consecutive free ports for a job whose local rank r serves ``base + r``: all of them bindable, and
below the kernel's ephemeral range, where outgoing connections cannot take one."""

import socket

import pytest

from trainer.parallel.launch import free_port_run


def test_every_port_of_the_run_is_free_and_below_the_ephemeral_range(tmp_path):
    port_range = tmp_path / "ip_local_port_range"
    port_range.write_text("20000\t60999\n")
    for _ in range(20):
        base = free_port_run(3, port_range)
        assert 10000 <= base and base + 3 <= 20000
        sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(3)]
        try:
            for offset, sock in enumerate(sockets):
                sock.bind(("0.0.0.0", base + offset))
        finally:
            for sock in sockets:
                sock.close()


def test_a_taken_port_is_never_part_of_a_run(tmp_path):
    port_range = tmp_path / "ip_local_port_range"
    port_range.write_text("10004 60999\n")  # the one run of 3 that fits below 10004 is 10000-10002
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("0.0.0.0", 10002))
        with pytest.raises(RuntimeError, match="no 3 consecutive free ports"):
            free_port_run(3, port_range)
