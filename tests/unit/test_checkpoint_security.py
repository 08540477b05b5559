"""Checkpoints are loaded without running pickled code: a tampered file is refused, by name,
before anything (DeepSpeed included) unpickles it; RNG states are stored as plain data."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from trainer.checkpoint.rng_state import RngState, rng_states, set_rng_states
from trainer.checkpoint.safe_load import UnsafeCheckpointError, load_data, refuse_pickled_code
from trainer.drills.catalogue import TouchesAFile
from trainer.parallel.dims import single_process_dims


def _tampered(path: Path, marker: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"weights": torch.zeros(2), "payload": TouchesAFile(marker)}, path)
    return path


def test_the_payload_would_run_if_unpickled(tmp_path):
    """The fixture is a real attack: the unsafe load does create the file."""
    marker = tmp_path / "ran"
    torch.load(_tampered(tmp_path / "x.pt", marker), weights_only=False)
    assert marker.exists()


def test_a_tampered_deepspeed_file_is_refused_before_deepspeed_reads_it(tmp_path):
    marker = tmp_path / "ran"
    torch.save(
        {"module": {"w": torch.ones(3)}}, _tampered(tmp_path / "ckpt" / "deepspeed" / "a.pt", marker).parent / "b.pt"
    )
    bad = tmp_path / "ckpt" / "deepspeed" / "a.pt"
    with pytest.raises(UnsafeCheckpointError, match=r"deepspeed/a\.pt: refusing to load it: it references getattr"):
        refuse_pickled_code(tmp_path / "ckpt" / "deepspeed")
    assert not marker.exists() and bad.exists()
    assert torch.equal(load_data(bad.parent / "b.pt")["module"]["w"], torch.ones(3))  # plain data loads


def test_a_tampered_rng_file_is_refused(tmp_path):
    marker = tmp_path / "ran"
    (tmp_path / "trainer.json").write_text(json.dumps({"world_size": 1}))
    _tampered(tmp_path / "rng" / "rank-00000.pt", marker)
    with pytest.raises(UnsafeCheckpointError, match="rank-00000.pt"):
        RngState(seed=0, position=SimpleNamespace(global_step=0)).load_from(tmp_path, single_process_dims())
    assert not marker.exists()


def test_rng_states_round_trip_as_plain_data(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.standard_normal()  # leaves a cached gaussian in numpy's state
    torch.save(rng_states(), tmp_path / "rng.pt")
    expected = (random.random(), np.random.standard_normal(3), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    set_rng_states(load_data(tmp_path / "rng.pt"))
    got = (random.random(), np.random.standard_normal(3), torch.rand(3))
    assert got[0] == expected[0]
    np.testing.assert_array_equal(got[1], expected[1])
    assert torch.equal(got[2], expected[2])
