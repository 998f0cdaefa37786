"""One picture of a pool's health from a live runtime's own metrics (issue 22): the recycle → Ready
histogram and the boot-kind mix, rendered to a PNG.

    uv run python bench/metrics_picture.py [--leases 12] [--cycle-every 4] [--out docs/metrics-picture.png]

Starts one runtime on the tiny guest with a cache of its own (so its first boot is cold and
captures the memory snapshot) and its health listener on; then ``--leases`` leases as the exporter
runs them: claim, a reading of the state, every ``--cycle-every``-th lease a power cycle (a boot
inside a lease), and the recycle that ends it. It then scrapes ``GET /metrics`` once with
``prometheus_client``'s parser and draws what the scrape says, nothing measured on the side: the
``vmsidecar_recycle_to_ready_seconds`` buckets with the p50 and p95 Prometheus'
``histogram_quantile`` would give, and ``vmsidecar_boots_total`` by kind with the snapshot lookups'
reasons. The figures are printed too. matplotlib is a dev dependency (the images never carry it).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import math
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from vmsidecar_contract.client import RuntimeClient
from vmsidecar_contract.process import RuntimeProcess, clean_environ

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "docs" / "metrics-picture.png"
BOOT_KINDS = ("cold", "restored", "registry_warm")


@dataclass
class Scrape:
    """The samples of one exposition: name → [(labels, value)]."""

    samples: dict[str, list[tuple[dict[str, str], float]]]

    def value(self, name: str, **labels: str) -> float:
        return sum(v for got, v in self.samples.get(name, []) if labels.items() <= got.items())

    def buckets(self, name: str, **labels: str) -> list[tuple[float, float]]:
        """(upper bound, cumulative count) of a histogram, in order; +Inf last."""
        found: dict[float, float] = {}
        for got, v in self.samples.get(f"{name}_bucket", []):
            if labels.items() <= got.items():
                le = float(got["le"])
                found[le] = found.get(le, 0.0) + v
        return sorted(found.items())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> Scrape:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics", headers={"Connection": "close"})
        response = conn.getresponse()
        body = response.read()
    finally:
        conn.close()
    if response.status != 200:
        sys.exit(f"GET /metrics on the health listener answered {response.status}: this runtime has no metrics")
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            samples.setdefault(s.name, []).append((dict(s.labels), s.value))
    return Scrape(samples)


def quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' ``histogram_quantile``: linear within the bucket the rank falls in."""
    total = buckets[-1][1] if buckets else 0.0
    if total == 0:
        return math.nan
    rank = q * total
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower  # the highest finite bound, as Prometheus answers
            return lower + (upper - lower) * (rank - below) / (count - below) if count > below else upper
        lower, below = upper, count
    return lower


async def drive(leases: int, cycle_every: int, work: Path, image: str, memory: str) -> tuple[Scrape, str]:
    """Run the leases; the scrape at the end and the accelerator the guest ran on."""
    port = _free_port()
    spec = {"image": image, "memory": memory}
    rt = RuntimeProcess.start(work / "rt", spec=spec, cache=work / "cache", env=clean_environ(),
                              args=["--health-listen", f"127.0.0.1:{port}"])
    try:
        await rt.wait_serving()
        async with RuntimeClient(rt.socket) as client:
            started = time.monotonic()
            await client.wait_ready(600)
            print(f"first boot (cold, captures the snapshot): Ready after {time.monotonic() - started:.1f} s")
            for n in range(1, leases + 1):
                await client.claim()
                await client.state()
                if cycle_every and n % cycle_every == 0:
                    await client.power("off", graceful=False)
                    await client.power("on")
                    await client.wait_ready(600)
                t0 = time.monotonic()
                await client.recycle()
                await client.wait_ready(600)
                print(f"lease {n}: recycle → Ready {time.monotonic() - t0:.2f} s (client side)")
            accel = (await client.state()).accel or "?"
        return scrape(port), accel
    finally:
        rt.stop()


def render(data: Scrape, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    buckets = data.buckets("vmsidecar_recycle_to_ready_seconds")
    labels, counts, lower, below = [], [], 0.0, 0.0
    for upper, cumulative in buckets:
        labels.append(f">{lower:g}" if math.isinf(upper) else f"{lower:g}-{upper:g}")
        counts.append(cumulative - below)
        lower, below = upper, cumulative
    while len(counts) > 1 and counts[-1] == 0:  # the empty buckets above the slowest recycle say nothing
        labels.pop()
        counts.pop()
    p50, p95 = quantile(0.5, buckets), quantile(0.95, buckets)

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), gridspec_kw={"width_ratios": [3, 2]})
    left.bar(range(len(counts)), counts, color="#3b7dd8")
    left.set_xticks(range(len(counts)), labels, rotation=45, ha="right", fontsize=8)
    left.set_xlabel("seconds (the histogram's buckets)")
    left.set_ylabel("recycles")
    left.set_title(f"recycle → Ready: p50 {p50:.2f} s, p95 {p95:.2f} s (n={int(below)})", fontsize=10)

    kinds = [data.value("vmsidecar_boots_total", kind=k) for k in BOOT_KINDS]
    bars = right.barh(BOOT_KINDS, kinds, color=["#d8843b", "#3bb273", "#8e6bd8"])
    right.bar_label(bars, [f"{int(k)}" for k in kinds], padding=3, fontsize=8)
    right.invert_yaxis()
    right.set_xlabel("boots")
    misses = {got["reason"]: v for got, v in data.samples.get("vmsidecar_snapshot_lookups_total", [])
              if got.get("result") == "miss" and v}
    hits = data.value("vmsidecar_snapshot_lookups_total", result="hit")
    note = ", ".join(f"{r} {int(v)}" for r, v in sorted(misses.items())) or "none"
    right.set_title(f"boots by kind\nsnapshot lookups: {int(hits)} hits\nmisses: {note}", fontsize=9)
    right.margins(x=0.2)
    fig.suptitle(title, fontsize=9, color="#555555")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--leases", type=int, default=12)
    p.add_argument("--cycle-every", type=int, default=4, help="power-cycle in every N-th lease (0: never)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--image", help="default: the tiny guest built by vmsidecar-image")
    p.add_argument("--memory", default="256M")
    args = p.parse_args()
    image = args.image
    if image is None:
        from vmsidecar_images.build import build_image

        image = f"file:{build_image('tiny').disk}"
    with tempfile.TemporaryDirectory(prefix="metrics-picture-") as tmp:
        data, accel = asyncio.run(drive(args.leases, args.cycle_every, Path(tmp), image, args.memory))
    buckets = data.buckets("vmsidecar_recycle_to_ready_seconds")
    load = os.getloadavg()
    print(f"from /metrics: {int(data.value('vmsidecar_recycles_total', outcome='ok'))} recycles ok, "
          f"{int(data.value('vmsidecar_recycles_total', outcome='error'))} failed; recycle → Ready "
          f"p50 {quantile(0.5, buckets):.2f} s, p95 {quantile(0.95, buckets):.2f} s (histogram_quantile); boots "
          + ", ".join(f"{k} {int(data.value('vmsidecar_boots_total', kind=k))}" for k in BOOT_KINDS)
          + f"; leases claimed {int(data.value('vmsidecar_leases_claimed_total'))}; load {load[0]:.1f}")
    title = (f"one runtime, tiny guest, {args.leases} leases ({time.strftime('%Y-%m-%d')}, "
             f"{accel.upper()}, load {load[0]:.1f}): "
             "vmsidecar_recycle_to_ready_seconds, vmsidecar_boots_total")
    render(data, args.out, title)
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
