"""Starting ranks: the container's entry point (``instcls launch``) and local worker processes.

``launch``: ``instcls launch ARGS...`` runs torchrun (``python -m trainer.parallel.torchrun_agent ARGS...``:
``torch.distributed.run`` with the agent's stops given ``--shutdown-timeout``) as a child,
forwards SIGTERM/SIGINT to it and exits with a code a Job controller can act on
(``trainer.exit_codes``): 0 when the run finished, 143 when it was preempted (retry), 2-4 when a
retry cannot help.  torchrun alone cannot say which: it exits 1 whenever a worker failed, whatever
the worker's code, and also after a SIGTERM it forwarded.  So every worker writes its own exit code
into ``INSTCLS_EXIT_CODE_DIR`` (``run_reporting_exit_code``) and the launcher reads the last round's
when torchrun is done; at the first code a restart cannot heal (2-4) it stops torchrun at once
(``hopeless_failure``) rather than let it restart up to ``--max-restarts`` times.  An elastic
launch (``--nnodes MIN:MAX``) tells the ranks its world sizes (``elastic_range``), and a pod that
knows its index names the rendezvous store's host (``rendezvous_host``).
torchrun's stderr passes through unchanged; when the job fails because its port was taken or the
rendezvous never completed, one last line says what to change (torchrun's own text is a traceback).
With a dynamic rendezvous (``--rdzv-backend c10d``, the multi-node setting) each rendezvous round
gets a store of its own (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``): by default torchrun shares one
store across rounds, and workers of a new round can neither tell their keys from a killed round's
nor agree on a per-round prefix (``_store_of_this_attempt`` in ``trainer.parallel.dims``).
torchrun SIGKILLs its workers 30 s after forwarding SIGTERM unless told otherwise, far less than a
checkpoint save of a large job; so the pod's grace period (``INSTCLS_GRACE_PERIOD_S``, set next to
``terminationGracePeriodSeconds`` in the manifests) becomes torchrun's ``--shutdown-timeout``.

``spawn_local_workers``: T local processes that look exactly like a torchrun job to the code they
run; used by the benchmarks (``instcls bench`` spawns its own ranks) and the multi-rank tests.
Each worker gets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT, an even share of the
CPU cores, and its process group is destroyed when the function returns.  Without CUDA the workers
fork from a server that imported torch, DeepSpeed and the trainer once (``PRELOADED_MODULES``)
rather than each importing them again; with CUDA they are spawned, fresh interpreters.
"""

from __future__ import annotations

import atexit
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from multiprocessing import forkserver, reduction
from pathlib import Path
from typing import Any, Callable

from trainer.exit_codes import (
    EXIT_CODE_ENV,
    ExitCode,
    any_rank_started,
    node_exit_code,
    reported_exit_codes,
    with_lost_store_host,
)
from trainer.parallel.elastic_range import WORLD_SIZES_ENV, world_sizes_of_launch
from trainer.parallel.hopeless_failure import HopelessFailureWatch
from trainer.parallel.launch_notices import RendezvousNotice, failure_cause_line, rendezvous_description
from trainer.parallel.rendezvous_host import with_rendezvous_host

# (what torchrun's stderr says, what to change): the failures a user fixes in the command, not the code
_LAUNCH_ADVICE = (
    (("EADDRINUSE", "address already in use"),
     "the rendezvous port is taken on this machine (another job, or an earlier run still exiting): pass another "
     "--master-port (or the port of --rdzv-endpoint), or --standalone for a single node to pick a free one"),
    (("RendezvousTimeoutError",),
     "not every node joined the rendezvous in time: check that --nnodes matches the pods started, that each pod "
     "reaches --rdzv-endpoint (the headless service's DNS name and port), or raise --rdzv-conf join_timeout=SECONDS"),
    (("RendezvousConnectionError",),
     "the rendezvous endpoint could not be reached: check --rdzv-endpoint / --master-addr and that its port is open; "
     "if the job was running, the node hosting the rendezvous store (node 0) was lost: this node rejoins when it "
     "is restarted after node 0's replacement is up"),
)


def launch_advice(stderr_tail: str) -> str | None:
    """One line of advice for a failed launch, from the end of torchrun's stderr."""
    for needles, advice in _LAUNCH_ADVICE:
        if any(needle in stderr_tail for needle in needles):
            return advice
    return None


def _pass_through(stream, tail: bytearray, keep: int = 1 << 16) -> None:
    """Copy the child's stderr to ours as it comes (progress bars stay live), keeping its end."""
    while chunk := os.read(stream.fileno(), 1 << 14):
        sys.stderr.buffer.write(chunk)
        sys.stderr.buffer.flush()
        tail.extend(chunk)
        del tail[:-keep]


GRACE_ENV = "INSTCLS_GRACE_PERIOD_S"
# Of the pod's grace period, what torchrun's own exit and ours need after the workers are gone:
# the kubelet SIGKILLs the whole container when the grace period ends.
SHUTDOWN_MARGIN_S = 30


def torchrun_command(torchrun_args: list[str], environ: dict[str, str] | None = None) -> list[str]:
    """torchrun (``trainer.parallel.torchrun_agent``), with ``--shutdown-timeout`` from the grace period unless
    given."""
    environ = os.environ if environ is None else environ
    command = [sys.executable, "-m", "trainer.parallel.torchrun_agent"]  # torchrun, its agent's stops patient
    given = any(arg.split("=", 1)[0] in ("--shutdown-timeout", "--shutdown_timeout") for arg in torchrun_args)
    grace = environ.get(GRACE_ENV)
    if grace is not None and not given:
        if not grace.isdigit() or int(grace) <= SHUTDOWN_MARGIN_S:
            raise ValueError(f"{GRACE_ENV}={grace!r} is invalid: set it to the pod's terminationGracePeriodSeconds "
                             f"(a whole number of seconds above {SHUTDOWN_MARGIN_S}, e.g. 600)")
        command.append(f"--shutdown-timeout={int(grace) - SHUTDOWN_MARGIN_S}")
    return command + list(torchrun_args)


FRESH_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def torchrun_environment(reports: Path, environ: dict[str, str] | None = None,
                         torchrun_args: list[str] = ()) -> dict[str, str]:
    """torchrun's environment: where ranks report their exit codes, a fresh store per rendezvous
    round (unless the user chose otherwise; static rendezvous ignores it), and the world sizes an
    elastic launch (``--nnodes MIN:MAX``) allows, for the ranks to check at start."""
    environ = dict(os.environ if environ is None else environ)
    environ.setdefault(FRESH_STORE_ENV, "1")
    world_sizes = world_sizes_of_launch(list(torchrun_args), environ)
    if world_sizes is not None:
        environ[WORLD_SIZES_ENV] = ",".join(map(str, world_sizes))
    return dict(environ, **{EXIT_CODE_ENV: str(reports)})


def launch(torchrun_args: list[str]) -> int:
    torchrun_args = with_rendezvous_host(torchrun_args)  # pod 0 hosts the c10d store, named
    command = torchrun_command(torchrun_args)
    reports = Path(tempfile.mkdtemp(prefix="instcls-exit-codes-"))
    child = subprocess.Popen(command, env=torchrun_environment(reports, torchrun_args=torchrun_args),
                             stderr=subprocess.PIPE)
    tail = bytearray()
    reader = threading.Thread(target=_pass_through, args=(child.stderr, tail), daemon=True)
    reader.start()
    received: list[int] = []

    def forward(signum, frame) -> None:
        received.append(signum)
        child.send_signal(signum)

    previous = {signum: signal.signal(signum, forward) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        with RendezvousNotice(reports, lambda: rendezvous_description(torchrun_args)), \
                HopelessFailureWatch(reports, child) as hopeless:
            returncode = child.wait()
    finally:
        # Put the caller's handlers back: a handler left forwarding to a finished child would
        # swallow the SIGTERM meant for this process or for any process it forks later.
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    reader.join()
    rank_codes = reported_exit_codes(reports)
    if hopeless.stopped_for is not None:  # kept even if torchrun began another round before it stopped
        rank_codes.append(hopeless.stopped_for)
    cause, ranks_started = failure_cause_line(reports), any_rank_started(reports)
    shutil.rmtree(reports, ignore_errors=True)
    code = with_lost_store_host(node_exit_code(returncode, rank_codes, signal.SIGTERM in received), ranks_started,
                                tail.decode(errors="replace"))
    ranks = f"torchrun exited {returncode}, this node's ranks {sorted(set(rank_codes)) or 'reported nothing'}"
    if code == ExitCode.PREEMPTED:
        print(f"instcls launch: preempted, exiting {code} (retry: the same command resumes from the newest complete "
              f"checkpoint; {ranks})", flush=True)
    elif code != ExitCode.FINISHED:
        meaning = ExitCode(code).name if code in ExitCode.__members__.values() else "not an instcls code"
        advice = launch_advice(tail.decode(errors="replace"))
        print(f"instcls launch: exiting {code} ({meaning}; {ranks})" + (f": {advice}" if advice else ""),
              file=sys.stderr, flush=True)
        if cause is not None and advice is None:
            print(cause, file=sys.stderr, flush=True)
    return code


def free_port() -> int:
    """A TCP port on the loopback interface that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


EPHEMERAL_PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port_run(count: int, port_range: Path = EPHEMERAL_PORT_RANGE) -> int:
    """The first of ``count`` consecutive ports that were all free a moment ago, for a job whose local
    rank r serves ``base + r``.  ``free_port() + 1`` is not one: a bind to port 0 is given an ephemeral
    port, and the kernel gives its neighbours to outgoing connections (gloo's, a scraper's), so on a
    busy machine ``+ 1`` is taken by the time the job binds it.  The run is picked below the ephemeral
    range, where only an explicit bind can take a port."""
    try:
        ephemeral_low = int(port_range.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768  # Linux's default range starts here
    generator = random.Random()
    for _ in range(200):
        base = generator.randrange(10000, max(ephemeral_low - count, 10001))
        sockets = []
        try:
            for port in range(base, base + count):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sockets.append(sock)
                sock.bind(("0.0.0.0", port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports between 10000 and {ephemeral_low}")


CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "<quota> <period>" or "max <period>"


def usable_cores(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """Cores this process may use: its CPU affinity (a container's cpuset), capped by a cgroup CPU
    quota (``docker --cpus``, a Kubernetes CPU limit), which affinity does not show.  Not
    ``os.cpu_count()``, which counts the whole host."""
    cores = len(os.sched_getaffinity(0))
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass  # no cgroup v2 file here (or an unreadable one): affinity alone
    return cores


def cpu_threads_per_rank(world_size: int) -> int:
    """Intra-op threads for one of ``world_size`` locally spawned CPU ranks: ``OMP_NUM_THREADS``
    where set, else an equal share of the usable cores (T ranks oversubscribing the cores makes
    every rank slower)."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    return max(1, usable_cores() // world_size)


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple,
            ranks_per_node: int | None = None, caller: _Caller | None = None) -> None:
    per_node = ranks_per_node or world_size
    if caller is not None:  # forked from the preloaded server: the caller's environment and output as of now
        caller.adopt()
    os.environ.update(  # torchrun's numbering: node by node
        RANK=str(rank),
        LOCAL_RANK=str(rank % per_node),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(per_node),
        GROUP_RANK=str(rank // per_node),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch

    from trainer.parallel.dims import shutdown_distributed

    if not torch.cuda.is_available():
        torch.set_num_threads(cpu_threads_per_rank(world_size))
    try:
        fn(*args)
    finally:
        shutdown_distributed()
    # The work is done and reported; skip the interpreter's teardown, where third-party C++ threads
    # (DeepSpeed ZeRO-3 on CPU) have been seen to abort ("terminate called without an active
    # exception") and turn a finished, correct run into a failed one.  Failures raised above still
    # reach the parent through torch.multiprocessing as before.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_local_workers(fn: Callable[..., Any], world_size: int, *args: Any, ranks_per_node: int | None = None
                        ) -> None:
    """Run ``fn(*args)`` in ``world_size`` fresh processes and wait for all of them.

    ``fn`` must be importable (a module-level function).  An exception in any worker is re-raised
    here with that worker's traceback.  ``ranks_per_node``: the processes see torchrun's environment
    of nodes of that many ranks (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``), as a
    multi-node job sets it; default one node.
    """
    import torch
    import torch.multiprocessing as mp

    if torch.cuda.is_available():  # a forked CUDA runtime is unusable: fresh interpreters
        mp.start_processes(_worker, args=(world_size, free_port(), fn, args, ranks_per_node), nprocs=world_size,
                           start_method="spawn")
        return
    _preloaded_server()
    mp.start_processes(_worker, args=(world_size, free_port(), fn, args, ranks_per_node, _Caller()),
                       nprocs=world_size, start_method="forkserver")


class _Caller:
    """What a spawned rank inherits from the process that starts it and a rank forked from the
    server would take from the server instead: the environment and stdout/stderr (the server's are
    the caller's of the moment it started; pytest, for one, points them elsewhere for every test)."""

    def __init__(self):
        self.environ = dict(os.environ)
        self.stdio: tuple = ()

    def __reduce__(self):  # pickled while the rank is started: the file descriptors travel with it
        return _Caller._rebuilt, (self.environ, reduction.DupFd(1), reduction.DupFd(2))

    @staticmethod
    def _rebuilt(environ: dict[str, str], stdout, stderr) -> _Caller:
        caller = _Caller.__new__(_Caller)
        caller.environ, caller.stdio = environ, (stdout, stderr)
        return caller

    def adopt(self) -> None:
        os.environ.clear()
        os.environ.update(self.environ)
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, inherited in zip((1, 2), self.stdio):
            received = inherited.detach()
            os.dup2(received, fd)
            os.close(received)


# What every local rank imports before its first line of work: torch, DeepSpeed, torch.distributed.checkpoint
# (with torch._dynamo, sympy, Triton) and the trainer, ~8 s of CPU per process.  Imported once, in
# multiprocessing's fork server, each CPU rank forks from it with them loaded; still a process of its own
# (fresh memory peak and cap, its own process group), with the caller's working directory, sys.path and
# environment at the time of the call.
PRELOADED_MODULES = ["torch", "trainer.parallel.deepspeed_import", "trainer.checkpoint", "trainer.config",
                     "trainer.engine.deepspeed_setup"]
_server_environment: dict[str, str] | None = None


def _preloaded_server() -> None:
    """Start the fork server (once), or restart it when the environment changed since: modules read
    some variables when imported (``DS_ACCELERATOR``, ``TRITON_INTERPRET``)."""
    global _server_environment
    environment = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    if environment == _server_environment:
        return
    if _server_environment is None:  # the server ends with this process, waited for (its CPU time counted)
        atexit.register(forkserver._forkserver._stop)
    else:
        forkserver._forkserver._stop()
    forkserver.set_forkserver_preload(PRELOADED_MODULES)
    _server_environment = environment
