"""``device_sync_sites``: each warning of CUDA's sync debug mode is recorded with the source line
that made the synchronizing call (the GPU run's figures name their sites this way).  Without a GPU
the mode is switched by a stand-in and the warning is raised as torch raises it: from the call."""

from __future__ import annotations

import warnings

import torch

from trainer.dry_run.host_syncs import device_sync_sites


def _a_synchronizing_call() -> None:
    warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)


def test_each_sync_is_recorded_with_its_source_line_and_the_mode_is_restored(monkeypatch):
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    with device_sync_sites() as sites:
        _a_synchronizing_call()
        warnings.warn("an unrelated warning", UserWarning, stacklevel=1)
        _a_synchronizing_call()
    assert modes == ["warn", "default"]
    assert len(sites) == 2 and all("test_device_sync_sites.py" in site and "_a_synchronizing_call" in site
                                   for site in sites)
