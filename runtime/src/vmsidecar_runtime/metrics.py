"""The runtime's Prometheus metrics: one registry of its own, every metric, and what is read at scrape time.

Served as ``GET /metrics`` on the health-only listener (``api/health.py``); the names are fixed
(docs/operations.md lists them, the dashboard queries them). Counters and histograms are updated
where things happen (``controller/``, the API's error rendering, the console hubs, the cache);
values that are a state rather than an event (phase, generation, QEMU's RSS, the cache's size) are
read when scraped, by :class:`StateCollector`, so nothing has to keep them up to date.

Every label takes its values from a fixed set declared here, and each is created at zero, so a
series exists before its first event (a rate over a missing series is no rate) and nothing a lease
holder sends can create one (no unbounded cardinality).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from vmsidecar_contract.errors import registry as error_registry
from vmsidecar_contract.state import Phase

__all__ = ["CONTENT_TYPE_LATEST", "REGISTRY", "State", "StateCollector", "bind", "exposition"]

#: no ``*_created`` series: they double the exposition, and a counter's start is the process's
disable_created_metrics()
REGISTRY = CollectorRegistry(auto_describe=True)

BootKind = Literal["cold", "restored", "registry_warm"]
#: cold: from the disk; restored: from the local cache's memory snapshot; registry_warm: from a
#: snapshot fetched from the spec's ``snapshot_source`` (the cache had none)
BOOT_KINDS: tuple[BootKind, ...] = ("cold", "restored", "registry_warm")
Source = Literal["oci", "http", "upload", "file"]
#: oci: a registry; file: file: and oci-layout: on the runtime's host; upload: PUT /v1/vm/disk;
#: http: declared for the dashboards, 0 here (the driver streams an https:// flash as an upload)
SOURCES: tuple[Source, ...] = ("oci", "http", "upload", "file")
#: why a boot did or did not restore a snapshot: the fixed set of ``snapshot_lookups_total``'s reasons
LOOKUP_REASONS = {
    "hit": "restored from the snapshot",
    "none_cached": "no snapshot yet for this key: this boot captures one",
    "uncapturable": "QEMU could not snapshot this guest earlier (a device that blocks migration)",
    "disabled": "snapshot: off in the spec",
    "backend_unsupported": "the backend has no memory snapshots (libvirt)",
    "arch_unsupported": "no vmgenid on this architecture (aarch64)",
    "flashed": "the disk was flashed in this lease",
    "lease_changes": "the disk has this lease's changes (a power cycle within a lease)",
    "readiness_invalid": "the image's readiness annotation is invalid",
    "seal_broken": "the snapshot failed its seal check (removed)",
    "refused": "the backend refused the snapshot (discarded)",
}
LookupReason = Literal["hit", "none_cached", "uncapturable", "disabled", "backend_unsupported", "arch_unsupported",
                       "flashed", "lease_changes", "readiness_invalid", "seal_broken", "refused"]

#: a restore takes ~0.1-1 s, a TCG cold boot 5-60 s, a debian guest's up to minutes
_BOOT_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)
_TRANSFER_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 900, 1800)

leases_claimed = Counter("vmsidecar_leases_claimed", "Leases that claimed the VM (POST /v1/vm/lease)",
                         registry=REGISTRY)
recycles = Counter("vmsidecar_recycles", "Recycles (by the API, or by a claim of a used generation), by outcome",
                   ["outcome"], registry=REGISTRY)
boots = Counter("vmsidecar_boots", "Boots from a powered-off guest, by kind (resets and guest reboots are not "
                "counted)", ["kind"], registry=REGISTRY)
boot_to_ready = Histogram("vmsidecar_boot_to_ready_seconds", "From a boot's start (Starting) to Ready, by kind",
                          ["kind"], buckets=_BOOT_BUCKETS, registry=REGISTRY)
recycle_to_ready = Histogram("vmsidecar_recycle_to_ready_seconds", "From a recycle's start to the fresh guest's Ready",
                             buckets=_BOOT_BUCKETS, registry=REGISTRY)
snapshot_capture = Histogram("vmsidecar_snapshot_capture_seconds", "Memory snapshot captures, the guest paused "
                             "(to the commit, or to the frozen copy of a guest that goes on)",
                             buckets=_BOOT_BUCKETS, registry=REGISTRY)
snapshot_restore = Histogram("vmsidecar_snapshot_restore_seconds", "Memory snapshot restores, checks to running "
                             "(the clock's correction included)", buckets=_BOOT_BUCKETS, registry=REGISTRY)
snapshot_lookups = Counter("vmsidecar_snapshot_lookups", "Whether a boot restored a snapshot (hit) or not, and why",
                           ["result", "reason"], registry=REGISTRY)
pull_bytes = Counter("vmsidecar_pull_bytes", "Bytes pulled (read from the source; 0 for a cache hit), by source",
                     ["source"], registry=REGISTRY)
pull_seconds = Histogram("vmsidecar_pull_seconds", "Successful pulls (the spec's image and flashes by reference), "
                         "by source", ["source"], buckets=_TRANSFER_BUCKETS, registry=REGISTRY)
flash_bytes = Counter("vmsidecar_flash_bytes", "Bytes a flash brought in (an upload's body, a reference's pull), "
                      "by source", ["source"], registry=REGISTRY)
flash_seconds = Histogram("vmsidecar_flash_seconds", "Successful flashes, request to installed, by source",
                          ["source"], buckets=_TRANSFER_BUCKETS, registry=REGISTRY)
dump_bytes = Counter("vmsidecar_dump_bytes", "Bytes of disk dumps sent (GET /v1/vm/disk)", registry=REGISTRY)
errors = Counter("vmsidecar_errors", "Errors answered, by the contract's error code (error statuses and the "
                 "error lines of progress streams)", ["code"], registry=REGISTRY)
console_bytes = Counter("vmsidecar_console_bytes", "Bytes the guest wrote to its consoles and channels",
                        registry=REGISTRY)
console_dropped_readers = Counter("vmsidecar_console_dropped_readers", "Console clients dropped for not reading",
                                  registry=REGISTRY)
cache_evictions = Counter("vmsidecar_cache_evictions", "Disks and snapshots evicted from the image cache (LRU, "
                          "over its budget)", registry=REGISTRY)

for _kind in BOOT_KINDS:
    boots.labels(_kind)
    boot_to_ready.labels(_kind)
for _outcome in ("ok", "error"):
    recycles.labels(_outcome)
for _reason in LOOKUP_REASONS:
    snapshot_lookups.labels("hit" if _reason == "hit" else "miss", _reason)
for _source in SOURCES:
    for _metric in (pull_bytes, pull_seconds, flash_bytes, flash_seconds):
        _metric.labels(_source)
_ERROR_CODES = frozenset(error_registry()) | {"internal_error"}
for _code in _ERROR_CODES:
    errors.labels(_code)


def snapshot_lookup(reason: LookupReason) -> None:
    """One boot's answer to "restore a snapshot?"."""
    snapshot_lookups.labels("hit" if reason == "hit" else "miss", reason).inc()


def error(code: str) -> None:
    """An error answered with ``code`` (a code outside the contract's set is counted as ``error``)."""
    errors.labels(code if code in _ERROR_CODES else "error").inc()


def source_of(reference: str) -> Source:
    """The source kind of a pull reference (``parse_reference``'s forms; no parsing, never raises)."""
    if reference.startswith(("file:", "oci-layout:", "/", "./", "../")):
        return "file"
    if reference.startswith(("http://", "https://")):
        return "http"
    return "oci"


# ---- read at scrape time ---------------------------------------------------------------------
@dataclass(frozen=True)
class State:
    """What the scrape reads from the runtime: the phase, the generation, the QEMUs' pids, the
    cache's size, what waits for the next recycle."""

    phase: Phase
    generation: int
    #: the guest's QEMU and, with the spec's ``standby``, its spare's
    qemu_pids: list[int]
    cache_bytes: int | None
    #: ``snapshot.standby`` of ``GET /v1/vm``: "ready" (a spare restore waits), "parked" (a parked QEMU), …
    standby: str = "off"


def rss_bytes(pid: int) -> int | None:
    """VmRSS of ``pid`` from /proc (None: gone, or not readable)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@contextlib.contextmanager
def outcome(counter: Counter) -> Iterator[None]:
    """Count the block under ``counter``'s ``outcome`` label: ``error`` when it raises, else ``ok``."""
    try:
        yield
    except Exception:
        counter.labels("error").inc()
        raise
    counter.labels("ok").inc()


def qemu_children(pids: Iterable[int]) -> list[int]:
    """Of the runtime's children, the QEMU processes: the guest's, and a spare restore's."""
    found = []
    for pid in sorted(pids):
        try:
            if os.path.basename(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0]).startswith(
                    b"qemu-system"):
                found.append(pid)
        except OSError:
            continue
    return found


class StateCollector(Collector):
    """The values that are a state: read from ``source`` at each scrape (nothing when unbound)."""

    def __init__(self) -> None:
        self.source: Callable[[], State] | None = None

    def describe(self) -> list[Metric]:
        return []  # generated at scrape time: the registry must not call collect() at register time

    def collect(self) -> Iterable[Metric]:
        if self.source is None:
            return
        state = self.source()
        phase = GaugeMetricFamily("vmsidecar_phase", "1 for the VM's current phase, 0 for every other", labels=["phase"])
        for p in Phase:
            phase.add_metric([p.value], 1 if p == state.phase else 0)
        yield phase
        yield GaugeMetricFamily("vmsidecar_generation", "The lease generation (bumped by every recycle)",
                                value=state.generation)
        rss = sum(rss_bytes(pid) or 0 for pid in state.qemu_pids)
        yield GaugeMetricFamily("vmsidecar_qemu_resident_memory_bytes", "QEMU's resident memory, a spare "
                                "restore's included (0: no QEMU runs)", value=rss)
        yield GaugeMetricFamily("vmsidecar_standby_ready", "1 while a spare restore waits for the next recycle "
                                "(the spec's standby)", value=1 if state.standby == "ready" else 0)
        yield GaugeMetricFamily("vmsidecar_standby_parked", "1 while a parked QEMU waits for the next recycle to "
                                "load the snapshot (the spec's standby: parked)", value=1 if state.standby == "parked" else 0)
        if state.cache_bytes is not None:
            yield GaugeMetricFamily("vmsidecar_cache_size_bytes", "Bytes on disk of the image cache (disks and "
                                    "memory snapshots)", value=state.cache_bytes)


STATE = StateCollector()
REGISTRY.register(STATE)


def bind(source: Callable[[], State]) -> None:
    """Read the state from ``source`` at every scrape (the runtime's one controller)."""
    STATE.source = source


def exposition() -> bytes:
    """The registry in Prometheus' text format (``CONTENT_TYPE_LATEST``)."""
    return generate_latest(REGISTRY)
