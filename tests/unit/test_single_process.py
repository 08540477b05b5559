"""`instcls train` without a launcher describes a one-process job instead of failing in DeepSpeed."""

from trainer.parallel.single_process import describe_single_process_job, single_process_job


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


def test_the_variables_of_a_one_process_job_last_as_long_as_the_job():
    """A notebook trains twice in one process: the second job needs a fresh port, so the first one's
    variables go when it ends (and a launcher's environment is never touched)."""
    environ = {"PATH": "/bin"}
    with single_process_job(environ) as line:
        assert "training as one process" in line and environ["WORLD_SIZE"] == "1"
        environ["DS_ACCELERATOR"] = "cpu"  # set during the job by someone else: kept
    assert environ == {"PATH": "/bin", "DS_ACCELERATOR": "cpu"}
    launched = {"WORLD_SIZE": "8", "RANK": "3"}
    with single_process_job(launched) as line:
        assert line is None
    assert launched == {"WORLD_SIZE": "8", "RANK": "3"}
