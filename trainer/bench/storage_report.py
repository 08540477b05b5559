"""`instcls bench data --storage`'s figures: a row per source from one rank's reads, then the read
rate with added latency over the rate without, which S3 client reads more per CPU second, and what
``ranks`` ranks at ``images_per_s`` ask of the store (``storage_demand``); and the printed table."""

from __future__ import annotations

from data_pipeline.storage.storage_settings import S3_CLIENTS
from trainer.bench.dataset_sizes import IMAGENET_21K
from trainer.bench.settings.data import GPU_STEP_IMAGES_PER_S, DataBenchSettings
from trainer.bench.step_reads import READ_AHEAD, ReadFigures
from trainer.bench.storage_demand import ASSUMED_IMAGENET_MEAN_BYTES, StoreDemand, rank_headroom

LATENCY_RATIO_GOAL = 0.8  # the read rate with latency_ms added, over the rate without: read-ahead must hide it


def source_row(name: str, location, reads: ReadFigures, decoded: float | None, client: str | None,
               delay_ms: float | None, images_per_s: float, rounds: list[float] | None = None) -> dict:
    """One source's figures, as the JSON summary holds them and ``format_report`` prints them."""
    return dict(
        source=name, location=str(location), client=client, delay_ms=delay_ms,
        read_samples_per_s=reads.samples_per_s, decoded_images_per_s=decoded,
        requests_per_s=reads.requests_per_s, requests_per_sample=reads.requests_per_sample,
        read_mb_per_s=reads.bytes / reads.seconds / 1e6, p50_ms=reads.p50_ms, p99_ms=reads.p99_ms,
        peak_in_flight=reads.peak_in_flight, read_threads=reads.read_threads, opens_per_s=reads.opens_per_s,
        opens_in_pass=reads.opens_in_pass, cpu_ms_per_sample=reads.cpu_seconds / reads.samples * 1e3,
        samples_per_cpu_s=reads.samples_per_cpu_s, errors=reads.errors, retries=reads.retries,
        headroom=rank_headroom(reads.samples_per_s, images_per_s), samples=reads.samples, seconds=reads.seconds,
        rounds_samples_per_s=rounds)


def summarise(settings: DataBenchSettings, rows: list[dict], mean_image_bytes: float, set_images: int,
              device: str, proxy_refusal: str | None = None, decode_backend: str | None = None) -> dict:
    """The rows, then the latency ratio, the clients' comparison and the job's demand."""
    by_name = {row["source"]: row for row in rows}
    delayed = [row for row in rows if row["delay_ms"] is not None]
    latency = None
    if len(delayed) == 2:
        zero, slow = delayed
        ratio = slow["read_samples_per_s"] / zero["read_samples_per_s"]
        latency = dict(delay_ms=slow["delay_ms"], zero_ms_samples_per_s=zero["read_samples_per_s"],
                       delayed_samples_per_s=slow["read_samples_per_s"], ratio=ratio, goal=LATENCY_RATIO_GOAL,
                       holds=ratio >= LATENCY_RATIO_GOAL, zero_ms_rounds=zero["rounds_samples_per_s"],
                       delayed_rounds=slow["rounds_samples_per_s"],
                       connections=max(zero.get("connections") or 0, slow.get("connections") or 0))
    clients = None
    direct = {client: by_name[f"s3 {client}"] for client in S3_CLIENTS if f"s3 {client}" in by_name}
    if len(direct) == len(S3_CLIENTS):
        best = max(direct, key=lambda client: direct[client]["samples_per_cpu_s"])
        other = next(client for client in direct if client != best)
        each = {client: dict(samples_per_s=row["read_samples_per_s"], samples_per_cpu_s=row["samples_per_cpu_s"])
                for client, row in direct.items()}
        clients = dict(each, faster_per_cpu_s=best,
                       per_cpu_s_ratio=direct[best]["samples_per_cpu_s"] / direct[other]["samples_per_cpu_s"])
    reference = by_name.get(f"s3 {settings.client}", rows[0])
    demand = StoreDemand(settings.ranks, settings.images_per_s, reference["requests_per_sample"], mean_image_bytes)
    assumed = StoreDemand(settings.ranks, settings.images_per_s, reference["requests_per_sample"],
                          ASSUMED_IMAGENET_MEAN_BYTES)
    return dict(device=device, decode_backend=decode_backend, batch=settings.batch, read_steps=settings.read_steps,
                read_ahead=READ_AHEAD, read_ahead_threads=settings.read_ahead_threads,
                max_in_flight=settings.max_in_flight, set_images=set_images, mean_image_bytes=mean_image_bytes,
                sources=rows, latency=latency, clients=clients, proxy_refusal=proxy_refusal,
                demand_reference=reference["source"],
                demand=demand.summary(IMAGENET_21K), demand_at_assumed_size=assumed.summary(IMAGENET_21K))


def _kb(count: float) -> str:
    return f"{count / 1e3:,.1f} KB"


def format_report(settings: DataBenchSettings, summary: dict) -> str:
    decoded = (f"{settings.decode_batches} batches decoded by {summary['decode_backend']} ({settings.views} x "
               f"{settings.crop_size}px)" if summary["decode_backend"] else "no decoding")
    lines = [
        f"one rank's reads on {summary['device']}: batch {summary['batch']}, {summary['read_steps']} steps read "
        f"{summary['read_ahead']} ahead by {summary['read_ahead_threads']} thread(s) as bytes only (S3: "
        f"{summary['max_in_flight']} in flight), {decoded}; "
        f"set of {summary['set_images']:,} images, mean {_kb(summary['mean_image_bytes'])}",
        f"{'source':<26}{'read/s':>9}{'decoded/s':>10}{'req/s':>9}{'p50 ms':>8}{'p99 ms':>8}{'in flight':>10}"
        f"{'opens/s':>8}{'CPU ms/sample':>14}{'MB/s':>8}{'x need':>8}",
    ]
    for row in summary["sources"]:
        decoded_text = "-" if row["decoded_images_per_s"] is None else f"{row['decoded_images_per_s']:.1f}"
        lines.append(f"{row['source']:<26}{row['read_samples_per_s']:>9.1f}{decoded_text:>10}"
                     f"{row['requests_per_s']:>9.1f}{row['p50_ms']:>8.2f}{row['p99_ms']:>8.2f}"
                     f"{row['peak_in_flight']:>10d}{row['opens_per_s']:>8.1f}{row['cpu_ms_per_sample']:>14.3f}"
                     f"{row['read_mb_per_s']:>8.1f}{row['headroom']:>7.2f}x")
    if summary["proxy_refusal"]:
        lines.append(summary["proxy_refusal"])
    latency = summary["latency"]
    if latency:
        delay = f"{latency['delay_ms']:g} ms"
        verdict = "holds" if latency["holds"] else "MISSED"
        lines.append(f"read rate with {delay} added / with 0 ms: {latency['ratio']:.2f} (goal >= "
                     f"{latency['goal']:.2f}: {verdict}), medians {latency['delayed_samples_per_s']:.1f} vs "
                     f"{latency['zero_ms_samples_per_s']:.1f} samples/s, proxy CPU counted on both")
        rounds = {label: "/".join(f"{rate:.0f}" for rate in latency[key])
                  for label, key in ((delay, "delayed_rounds"), ("0 ms", "zero_ms_rounds"))}
        lines.append(f"  rounds: {delay} {rounds[delay]}, 0 ms {rounds['0 ms']} samples/s; the client kept "
                     f"{latency['connections']} connections open for {summary['max_in_flight']} reads in flight")
    clients = summary["clients"]
    if clients:
        each = "; ".join(f"{client} {clients[client]['samples_per_s']:.1f} samples/s, "
                         f"{clients[client]['samples_per_cpu_s']:.1f} per CPU s" for client in S3_CLIENTS)
        lines.append(f"S3 clients on the same store: {each}: {clients['faster_per_cpu_s']} reads "
                     f"{clients['per_cpu_s_ratio']:.2f}x as many samples per CPU second")
    lines += demand_lines(settings, summary)
    return "\n".join(lines)


def demand_lines(settings: DataBenchSettings, summary: dict) -> list[str]:
    demand, assumed = summary["demand"], summary["demand_at_assumed_size"]
    source = ("docs/gpu-results.md's ResNet-50 step on one H200" if settings.images_per_s == GPU_STEP_IMAGES_PER_S
              else "--images-per-s")
    return [
        f"{demand['ranks']} ranks x {demand['images_per_s_per_rank']:,.1f} images/s ({source}) = "
        f"{demand['images_per_s']:,.0f} images/s ask the store for {demand['requests_per_s']:,.0f} requests/s "
        f"({demand['requests_per_sample']:.2f} per sample, as read from {summary['demand_reference']}) and "
        f"{demand['mb_per_s']:,.0f} MB/s at this set's mean {_kb(demand['mean_image_bytes'])}, "
        f"{assumed['mb_per_s']:,.0f} MB/s at ImageNet's ~{_kb(assumed['mean_image_bytes'])} (assumed)",
        f"ImageNet-21K ({demand['epoch_images']:,} images): an epoch at that rate takes "
        f"{demand['epoch_seconds']:,.0f} s "
        f"({demand['epoch_seconds'] / 60:.1f} min), {demand['epoch_requests'] / 1e6:.1f}M requests, "
        f"{demand['epoch_terabytes']:.2f} TB at {_kb(demand['mean_image_bytes'])} or "
        f"{assumed['epoch_terabytes']:.2f} TB at ~{_kb(assumed['mean_image_bytes'])} (assumed)",
    ]
