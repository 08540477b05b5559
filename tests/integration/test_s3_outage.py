"""A shard store that stops answering in the middle of a run: the ranks retry for
``data.storage.outage_retry_s``, then the run exits 1 (the Job's counted retry) with one line naming
the URL, its last checkpoint intact; once the store is back, the same command resumes from that
checkpoint and the run ends where an uninterrupted one does."""

import subprocess
import time

import pytest

from tests.helpers.training import REPO, losses_by_step, run_train, train_command
from trainer.drills.jobs import job_env

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.xdist_group("s3")]

SETTINGS = ["data.loader.batch_size=32", "data.loader.backend=torch", "data.loader.num_threads=1", "optim.epochs=5",
            "logging.log_every=1", "eval.knn_at_end=true", "eval.linear_at_end=false", "checkpoint.every_epochs=1",
            "parallel.deterministic=true",
            "data.storage.outage_retry_s=3", "data.storage.read_timeout_s=2", "data.storage.connect_timeout_s=1"]


def test_a_store_outage_mid_run_exits_1_and_the_run_resumes_once_it_is_back(tiny_digits_split, s3_server, tmp_path,
                                                                             monkeypatch):
    remote = {split: f"s3://instcls-outage/digits/{split}" for split in ("train", "val")}
    for split, url in remote.items():
        s3_server.sync_up(tiny_digits_split[split], url)
    env = job_env(**s3_server.client_env(), INSTCLS_TABLE_CACHE=str(tmp_path / "table-cache"))
    run_dir = tmp_path / "s3"
    process = subprocess.Popen(train_command(run_dir, remote, 2, SETTINGS, resume="auto"), cwd=REPO, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = run_dir / "logs" / "rank-00000.jsonl"
    deadline = time.monotonic() + 300
    while not (log.exists() and any('"step": 4,' in line and '"event": "step"' in line
                                    for line in log.read_text().splitlines())):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.1)
    s3_server.pause()  # epoch 2 is done and saved; epoch 3's reads find no store
    try:
        out, err = process.communicate(timeout=240)
    finally:
        s3_server.resume()
    assert process.returncode == 1, err[-3000:]
    assert "cannot read at" in err and "(data.storage.outage_retry_s=3;" in err, err[-3000:]
    saved = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*") if "." not in p.name)
    assert saved and saved[-1] >= "step_000000004", saved

    resumed = subprocess.run(train_command(run_dir, remote, 2, SETTINGS, resume="auto"), cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / saved[-1]}" in resumed.stdout + resumed.stderr

    monkeypatch.setenv("INSTCLS_TABLE_CACHE", str(tmp_path / "table-cache"))
    from_disk = run_train(tmp_path / "disk", tiny_digits_split, 2, SETTINGS)
    assert losses_by_step(run_dir) == losses_by_step(tmp_path / "disk")
    # the end-of-run kNN read its bank and queries from the bucket: the same scores as from disk
    scores = [[line.rsplit(" (", 1)[0] for line in out.splitlines() if "kNN accuracy" in line]
              for out in (resumed.stdout, from_disk.stdout)]
    assert scores[0] and scores[0] == scores[1]
    assert len(losses_by_step(run_dir)) == 10
