"""Shard sets shared by the data tests (written once per session), and an environment that is the
same on every machine."""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

# The suite tests the CPU paths (gloo ranks, host memory readings); what a developer's shell, a GPU
# box or a pod sets must not change what it runs.  Child processes inherit this environment.
# Tests marked ``gpu`` need the devices: INSTCLS_TEST_GPU=1 (on a GPU node) keeps them visible.
if os.environ.get("INSTCLS_TEST_GPU") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # two ranks on one visible GPU would share it and NCCL refuses
for name in [name for name in os.environ if name.startswith("TORCHELASTIC_")] + [
        "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
        "INSTCLS_FAILPOINT", "INSTCLS_FAILPOINT_ONCE", "INSTCLS_EXIT_CODE_DIR", "ATEN_CPU_CAPABILITY",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"]:
    # torchrun's (an in-process test would join a group), our fail point, a pinned vector ISA, and a
    # shell's choice of rendezvous store (`instcls launch` sets its own)
    os.environ.pop(name, None)
# One intra-op thread per process, in the xdist workers and every process they start: the suite runs
# several processes per core (3 workers, each test's ranks), where each torch's pool of one thread
# per core only spins against the others (6% of the suite's CPU on 2026-12-08), and reductions then
# add in the same order on a machine of any core count.  A test of the thread choice sets its own.
os.environ["OMP_NUM_THREADS"] = "1"
# Tests name shipped files relative to the repository (configs/..., ds_configs/...), wherever pytest
# was started from.
os.chdir(Path(__file__).resolve().parents[1])
# Compiler caches start empty, as on a new machine or in CI: a warm ~/.cache must never be what
# makes the suite pass.  INSTCLS_TEST_CACHE_DIR keeps them between runs where that is wanted.  One
# session shares one folder: pytest-xdist's workers inherit it from the controller, which made it
# and removes it at exit, as a job's ranks and pods share one cache.
_SESSION_CACHES_ENV = "_INSTCLS_TEST_SESSION_CACHE_DIR"
_CACHES = Path(os.environ.get("INSTCLS_TEST_CACHE_DIR") or os.environ.get(_SESSION_CACHES_ENV)
               or tempfile.mkdtemp(prefix="instcls-test-caches-"))
if not os.environ.get("INSTCLS_TEST_CACHE_DIR") and not os.environ.get(_SESSION_CACHES_ENV):
    os.environ[_SESSION_CACHES_ENV] = str(_CACHES)
    atexit.register(shutil.rmtree, _CACHES, ignore_errors=True)
for name, folder in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TORCH_EXTENSIONS_DIR", "torch_extensions"),
                     ("TRITON_CACHE_DIR", "triton")):
    os.environ[name] = str(_CACHES / folder)
# The tests' servers (metrics exporters, Prometheus) listen on the loopback: never through a proxy.
for name in ("no_proxy", "NO_PROXY"):
    os.environ[name] = ",".join(filter(None, [os.environ.get(name), "127.0.0.1", "localhost"]))

# Imported after the environment above is set: torch reads some of it when it loads.
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from PIL import Image  # noqa: E402

from data_pipeline.ingest.make_shards import ShardSettings, write_shards  # noqa: E402
from data_pipeline.ingest.sources.files import image_folder  # noqa: E402
from data_pipeline.ingest.sources.generated import sklearn_digits  # noqa: E402

COLOR_IMAGES = 45


def solid_color(index: int) -> tuple[int, int, int]:
    """A distinct, JPEG-stable colour per image (well apart in every channel)."""
    return (40 + 40 * (index % 5), 40 + 40 * ((index // 5) % 5), 60 + 60 * (index // 25))


@pytest.fixture(scope="session")
def digits_shards(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("digits")
    write_shards(sklearn_digits(32), out, ShardSettings(prefix="digits", samples_per_shard=400), progress=False)
    return out


@pytest.fixture(scope="session")
def color_folder(tmp_path_factory) -> Path:
    """ROOT/<class>/<image>.png: uniform-colour 40x40 images; the class is index % 3."""
    root = tmp_path_factory.mktemp("colors")
    for index in range(COLOR_IMAGES):
        class_dir = root / f"class{index % 3}"
        class_dir.mkdir(exist_ok=True)
        pixels = np.zeros((40, 40, 3), dtype=np.uint8) + np.array(solid_color(index), dtype=np.uint8)
        Image.fromarray(pixels).save(class_dir / f"img{index:03d}.png")
    return root


@pytest.fixture(scope="session")
def color_shards(color_folder, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("color_shards")
    write_shards(
        image_folder(color_folder, labels=True),
        out,
        ShardSettings(prefix="colors", samples_per_shard=10),
        progress=False,
    )
    return out


# The default suite's longest files, in seconds on 3 workers of this 2-core machine (2026-12-07): they
# start first, so that no minute-long test starts last while the other workers idle.
LONGEST_FIRST = {"test_pic_training": 145, "test_pod_drills": 113, "test_mlflow_tracking": 103,
                 "test_prometheus_scrape": 93, "test_swav_training": 60,
                 "test_export_round_trip": 61, "test_evaluation_guards": 58,
                 "test_bench_classifier": 57, "test_backbone_families": 57, "test_training": 47}


def pytest_collection_modifyitems(config, items):
    """Tests marked ``integration`` (seconds to minutes each) run first, the longest files first
    (``LONGEST_FIRST``), so that the quick ones fill the xdist workers' tail instead of a long test
    starting last.  Tests marked ``gpu`` are skipped,
    saying why, where no CUDA device is visible (CI)."""
    import torch

    # stable: the other files keep their order
    items.sort(key=lambda item: ("integration" not in item.keywords, -LONGEST_FIRST.get(item.path.stem, 0)))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: run with INSTCLS_TEST_GPU=1 on a GPU node")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """One signed-requests SeaweedFS server for the session (tests that use it share an xdist group,
    so one worker starts it); ``s3_server.client_env()`` is what a reading process needs."""
    from tests.helpers.s3_server import SeaweedServer

    server = SeaweedServer(tmp_path_factory.mktemp("seaweedfs"), signed=True).start()
    yield server
    server.stop()
