"""One JSON object per line per rank: easy to tail, grep and load into pandas."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from trainer.observability.memory import current_rss_bytes
from trainer.observability.record_sinks import RecordSink


class JsonlLog:
    """``sinks``: trackers (``RecordSink``: TensorBoard, MLflow) handed every record, so the log and
    they never differ; ``add_sink`` adds one that needs what the run learns after the log opens."""

    def __init__(self, directory: Path, rank: int, sinks: list[RecordSink] | tuple = ()) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = Path(directory) / f"rank-{rank:05d}.jsonl"
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 - open for the log's life, until close()
        self.sinks = [sink for sink in sinks if sink is not None]

    def add_sink(self, sink: RecordSink | None) -> None:
        if sink is not None:
            self.sinks.append(sink)

    def write(self, **record) -> None:
        record = {"time": round(time.time(), 3), **record}
        self._file.write(json.dumps(record) + "\n")
        for sink in self.sinks:
            sink.write(record)

    def attach(self, path: Path, name: str) -> None:
        """A file of the run (``run.json``, the summary, the model card) for the trackers that keep files."""
        for sink in self.sinks:
            sink.attach(Path(path), name)

    def close(self) -> None:
        self._file.close()
        for sink in self.sinks:
            sink.close()


def memory_readings(device: torch.device) -> dict[str, int]:
    """What ``instcls_memory_bytes`` reports: CUDA allocator figures on GPU, RSS on CPU.  On a GPU
    ``device_used`` is what the device itself reports in use (``cudaMemGetInfo``): beyond the
    allocator's figures it counts the CUDA context, NCCL's and DALI's buffers (and any other
    process on the same GPU)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return {
            "cuda_allocated": torch.cuda.memory_allocated(device),
            "cuda_reserved": torch.cuda.memory_reserved(device),
            "device_used": total - free,
        }
    return {"rss": current_rss_bytes()}
