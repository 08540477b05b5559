"""Room for one open handle per shard: the soft ``RLIMIT_NOFILE`` is raised at start, up to the hard
limit, and a hard limit too low for the shard set is refused with the fix."""

from __future__ import annotations

import resource

HEADROOM = 1024  # sockets, pipes, checkpoint files, DALI's and torch's own handles


def ensure_open_files(shards: int, where: str) -> int:
    """Raise the soft limit to fit ``shards`` handles plus ``HEADROOM``; returns the soft limit in force.
    ``where`` names the shard set in the error."""
    needed = shards + HEADROOM
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            raise ValueError(
                f"{where}: {shards} shards need {needed} open files per process (one handle per shard, kept open so "
                f"that no sample read opens a file), and this process may open at most {hard} (the hard "
                "RLIMIT_NOFILE): raise it (`ulimit -Hn`, the container runtime's nofile limit, or "
                "LimitNOFILE in systemd), or make the set with fewer, larger shards")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
        soft = needed
    return soft
