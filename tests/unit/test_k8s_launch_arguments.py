"""What `instcls launch` makes of each rendered overlay's arguments, pod by pod: the elastic overlays'
range passes the check every rank makes at its first start, with each shipped job config; and every
pod of a c10d rendezvous names whether it hosts the store (index 0 alone), in the one `--rdzv-conf`
torchrun keeps, beside the overlay's own timeouts."""

from __future__ import annotations

import pytest
import yaml
from torch.distributed.run import get_args_parser

from tests.helpers.k8s_manifests import K8S, rendered
from trainer.config import load_job_config
from trainer.elastic.world_range import check_elastic_range
from trainer.parallel.elastic_range import world_sizes_of_launch
from trainer.parallel.rendezvous_host import with_rendezvous_host

CONFIGMAPS = sorted(path.name for path in K8S.glob("configmap-*.yaml"))


def _training_args(overlay: str) -> tuple[list[str], int]:
    """The training container's arguments and the number of pods (an Indexed Job's completions)."""
    (job,) = [d for d in rendered(overlay) if d["kind"] == "Job" and d["metadata"]["name"] == "instcls-train"]
    return job["spec"]["template"]["spec"]["containers"][0]["args"], job["spec"]["completions"]


@pytest.mark.parametrize("configmap", CONFIGMAPS)
def test_the_elastic_overlay_s_range_passes_the_start_check_with_each_shipped_config(configmap, tmp_path):
    args, _ = _training_args("indexed-job-elastic")
    sizes = world_sizes_of_launch(args, {})
    assert sizes == (32, 40, 48, 56, 64)
    data = yaml.safe_load((K8S / configmap).read_text())["data"]
    overrides = [a.removeprefix("--set=") for a in args if a.startswith("--set=") and "deepspeed_config" not in a]
    (tmp_path / "job.yaml").write_text(data["job.yaml"])
    config = load_job_config(tmp_path / "job.yaml", overrides)
    global_batch = config.data.loader.batch_size * max(sizes)
    check_elastic_range(global_batch, sizes, config.objective.sizes_split_over_ranks())
    with pytest.raises(ValueError, match="does not split over 40, 48, 56 ranks"):  # the configs' own 64 per GPU
        check_elastic_range(64 * max(sizes), sizes, {})


@pytest.mark.parametrize("overlay", ["indexed-job", "indexed-job-elastic"])
def test_every_pod_names_whether_it_hosts_the_rendezvous_store(overlay):
    args, pods = _training_args(overlay)
    for index in range(pods):
        pod_args = [a.replace("$(JOB_COMPLETION_INDEX)", str(index)) for a in args]
        launched = with_rendezvous_host(pod_args)
        settings = get_args_parser().parse_args(launched)
        conf = dict(entry.split("=", 1) for entry in settings.rdzv_conf.split(","))
        assert conf["is_host"] == ("1" if index == 0 else "0"), (index, settings.rdzv_conf)
        if overlay.endswith("elastic"):  # the overlay's own entries kept in the one conf
            assert int(conf["join_timeout"]) >= 600 and int(conf["last_call_timeout"]) >= 60
        assert sum(a.startswith("--rdzv-conf") for a in launched) == 1
