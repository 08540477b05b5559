"""`instcls train` without a launcher describes a one-process job instead of failing in DeepSpeed."""

from trainer.parallel.single_process import describe_single_process_job


def test_without_a_launcher_the_job_is_one_local_rank_on_a_free_port():
    environ = {"PATH": "/bin"}
    line = describe_single_process_job(environ)
    assert "training as one process" in line and "instcls launch --nproc-per-node N" in line
    assert {k: environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")} == {
        "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    assert 0 < int(environ["MASTER_PORT"]) < 65536


def test_a_launchers_environment_is_left_alone():
    environ = {"WORLD_SIZE": "8", "RANK": "3"}
    assert describe_single_process_job(environ) is None
    assert environ == {"WORLD_SIZE": "8", "RANK": "3"}
