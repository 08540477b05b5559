"""What reading a local shard set asks of the filesystem: one open per shard per process (handles
stay open), one pread per sample, every count carried with the step to the trainer's metrics; and a
hard open-files limit too low for the set is refused with the fix."""

import subprocess
import sys

import numpy as np

from data_pipeline.loading.sample_reader import StepReader
from data_pipeline.loading.samplers.epoch_permutation import EpochPermutationSampler
from data_pipeline.shardset.sample_table import SampleTable
from data_pipeline.storage.stores import forget_stores
from trainer.observability.metrics import TrainingMetrics


def _sampler(count: int, batch: int) -> EpochPermutationSampler:
    return EpochPermutationSampler(count, world_size=1, batch_size=batch, seed=0)


def test_a_step_counts_one_read_per_sample_and_opens_each_shard_once(color_shards):
    forget_stores()  # handles other tests of this process opened would hide the opens
    table = SampleTable(color_shards)
    reader = StepReader(table, _sampler(table.num_samples, 15), rank=0, seed=0, augment=None)
    first = reader.read(0, 0).samples
    sizes = table.rows["size"][first.ids].astype(np.int64)
    assert first.reads.requests == len(first.ids)
    assert first.reads.bytes == int(sizes.sum())
    touched = len({int(table.rows["shard"][i]) for i in first.ids})
    assert first.reads.opens == touched  # labels are in the table: only the images are read
    assert first.reads.latencies_s.shape == (len(first.ids),)
    later = [reader.read(0, step).samples.reads for step in range(1, 3)]
    opened = {int(table.rows["shard"][i]) for step in range(3) for i in reader.sampler.step(0, step).ids[0]}
    assert first.reads.opens + sum(r.opens for r in later) == len(opened)  # never the same shard twice

    metrics = TrainingMetrics(rank=0)
    for reads in [first.reads, *later]:
        metrics.add_reads(reads)
    value = metrics.registry.get_sample_value
    assert value("instcls_shard_read_requests_total", {"rank": "0"}) == first.reads.requests + sum(
        r.requests for r in later)
    assert value("instcls_shard_read_seconds_count", {"rank": "0"}) == value("instcls_shard_read_requests_total",
                                                                               {"rank": "0"})
    assert value("instcls_shard_opens_total", {"rank": "0"}) == len(opened)


def test_a_hard_open_files_limit_below_the_shard_count_is_refused_with_the_fix():
    script = ("import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (256, 2048));\n"
              "from data_pipeline.storage.open_files import ensure_open_files\n"
              "print(ensure_open_files(100, 'small'))\n"
              "ensure_open_files(14198, '/data/in21k')")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "/data/in21k: 14198 shards need 15222 open files" in result.stderr
    assert "at most 2048 (the hard RLIMIT_NOFILE): raise it" in result.stderr
    assert result.stdout.strip() == "1124"  # 100 shards fit: the soft limit was raised for them and the headroom


def test_the_soft_open_files_limit_is_raised_up_to_the_hard_one():
    script = ("import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (64, 4096));\n"
              "from data_pipeline.storage.open_files import ensure_open_files\n"
              "print(ensure_open_files(2000, 'set'), resource.getrlimit(resource.RLIMIT_NOFILE)[0])")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.stdout.split() == ["3024", "3024"], result.stderr


def test_steps_read_at_once_each_count_exactly_their_own_reads(color_shards):
    """The DALI source reads 3 steps ahead on 3 threads: each step's tally holds its own samples' reads."""
    from concurrent.futures import ThreadPoolExecutor

    table = SampleTable(color_shards)
    reader = StepReader(table, _sampler(table.num_samples, 5), rank=0, seed=0, augment=None, read_threads=2)
    with ThreadPoolExecutor(3) as pool:
        steps = list(pool.map(lambda step: reader.read(0, step).samples, range(9)))
    for samples in steps:
        sizes = table.rows["size"][samples.ids].astype(np.int64)
        assert (samples.reads.requests, samples.reads.bytes) == (len(samples.ids), int(sizes.sum()))


def test_a_reader_pickled_into_a_spawned_process_opens_its_own_handles(color_shards, tmp_path):
    """DataLoader workers of a process that a forkserver started (Python 3.14's default) get the reader
    pickled: handle numbers of the parent would name nothing there, or another file."""
    import pickle

    table = SampleTable(color_shards)
    table.open_all()
    expected = [table.read_jpeg(i) for i in range(table.num_samples)]
    script = ("import pickle, sys\n"
              "table = pickle.load(open(sys.argv[1], 'rb'))\n"
              "print(sum(len(table.read_jpeg(i)) for i in range(table.num_samples)))")
    (tmp_path / "table.pkl").write_bytes(pickle.dumps(table))
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "table.pkl")], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert int(result.stdout) == sum(len(data) for data in expected)
