"""Every thread the trainer or the data pipeline starts either runs on its rank's device (built by
``device_thread_pool``) or is on the list below of threads that never touch CUDA, with the reason.
A thread that allocates, syncs a stream or creates an event without having set its device works on
GPU 0: on an 8-GPU node every rank then builds a CUDA context there."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCANNED = ("trainer", "data_pipeline")
THREAD_BUILDERS = {"ThreadPoolExecutor", "Thread", "Timer"}
DEVICE_POOL = ("trainer/parallel/device_threads.py", "device_thread_pool")

# (file, the function or class that builds the thread) -> why it never touches CUDA
CPU_ONLY = {
    ("data_pipeline/loading/dali_loader.py", "_StepSource._read_ahead"):
        "reads files and draws augmentation parameters in numpy; DALI's own threads get device_id",
    ("data_pipeline/loading/sample_reader.py", "StepReader._map"):
        "os.pread or ranged GETs of shard bytes, and image headers",
    ("data_pipeline/storage/s3_store.py", "S3Store.executor"): "ranged GETs of shard bytes, shared by the readers",
    ("data_pipeline/ingest/s3_staging.py", "fetch_records"): "GETs an ingest's shard records from S3 for its merge",
    ("trainer/bench/step_reads.py", "ReadAhead.__init__"): "reads shard bytes ahead, as the DALI source does",
    ("trainer/observability/exporter.py", "serve_bounded"): "serves the Prometheus registry's host-side values",
    ("trainer/parallel/launch.py", "launch"): "copies torchrun's stderr in the launcher, which never starts CUDA",
    ("trainer/parallel/background_watch.py", "BackgroundWatch.__init__"):
        "the launcher's watches of its ranks' exit reports; the launcher never starts CUDA",
    ("trainer/observability/trainjob_status.py", "TrainJobStatusReporter.__init__"):
        "POSTs JSON progress reports to the TrainJob's status endpoint",
    ("trainer/observability/mlflow_sink.py", "MlflowSink.__init__"):
        "sends the JSON log's scalars and the run's files to the MLflow server over HTTP",
    ("trainer/rehearsal/processes.py", "RankMemoryWatch.__enter__"): "reads the ranks' RSS from /proc",
    ("trainer/bench/point_failure.py", "PointFailure.__init__"): "polls the job's TCP store",
    ("trainer/bench/pic_bench.py", "_AnonPeak.__init__"): "reads this process's RSS from /proc",
    ("trainer/bench/exporter_bench.py", "_scraper_process"): "HTTP scrapes, in a process of their own",
}


def _thread_sites(path: Path) -> list[str]:
    """The qualified names of the functions in ``path`` that build a thread or a thread pool."""
    sites: list[str] = []

    def visit(node: ast.AST, scope: tuple[str, ...]) -> None:
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = scope + (child.name,)
                if isinstance(child, ast.ClassDef) and any(
                        (base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None))
                        in THREAD_BUILDERS for base in child.bases):
                    sites.append(".".join(inner))  # a Thread subclass
            elif isinstance(child, ast.Call):
                func = child.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if name in THREAD_BUILDERS:
                    sites.append(".".join(scope) or "<module>")
            visit(child, inner)

    visit(ast.parse(path.read_text(), str(path)), ())
    return sites


def _all_sites() -> set[tuple[str, str]]:
    found = set()
    for package in SCANNED:
        for path in sorted((REPO / package).rglob("*.py")):
            found |= {(path.relative_to(REPO).as_posix(), site) for site in _thread_sites(path)}
    return found


def test_every_thread_runs_on_the_rank_device_or_is_a_listed_cpu_only_one():
    unlisted = sorted(_all_sites() - set(CPU_ONLY) - {DEVICE_POOL})
    assert not unlisted, (
        f"threads built outside device_thread_pool: {unlisted}. Build a thread that can touch CUDA with "
        "trainer.parallel.device_threads.device_thread_pool(dims.device, name); list one that never does in "
        "CPU_ONLY with the reason")


def test_the_cpu_only_list_names_only_threads_that_exist():
    assert not set(CPU_ONLY) - _all_sites(), "a CPU_ONLY entry names no thread any more: remove it"


def test_the_scan_finds_a_pool_a_thread_and_a_thread_subclass(tmp_path):
    source = tmp_path / "sample.py"
    source.write_text("import threading\nfrom concurrent import futures\n"
                      "def prefetch():\n    return futures.ThreadPoolExecutor(1)\n"
                      "class Writer:\n    def start(self):\n        threading.Thread(target=print).start()\n"
                      "class Worker(threading.Thread):\n    pass\n")
    assert _thread_sites(source) == ["prefetch", "Writer.start", "Worker"]
