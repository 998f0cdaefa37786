"""Issue 22, runtime side: the Prometheus metrics and the audit trail, from a real runtime and guest.

One runtime (a cache of its own, so the first boot is cold and captures) goes through a boot, two
leases, a flash from a registry that needs credentials, a failed pull, a refused call, a dump and
two recycles; ``/metrics`` is scraped before and after with ``prometheus_client``'s parser and every
counter's and histogram count's delta is asserted exactly (every other series of those: 0). The
audit lines of those leases are asserted line by line, and no credential appears in any log line.
A fuzz pass over the health listener finds nothing but its three paths.
"""

from __future__ import annotations

import asyncio
import base64
import json
import posixpath
import random
import socket
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fixtures.events import collecting
from fixtures.health import health_runtime, http_get
from fixtures.registry import AUTH_PASSWORD, AUTH_USER, RunningRegistry, auth_file
from fixtures.runtime import qemu_pids
from fixtures.waiting import wait_until_async
from vmsidecar_contract.client import RuntimeClient
from vmsidecar_contract.errors import ImageError, StateError
from vmsidecar_runtime.metrics import rss_bytes
from vmsidecar_runtime.oci.cli import main as oci_main

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
#: what a lease holder puts in a reference, hoping it gets logged
HOLDER_SECRET = "holder-pw-77x"
POOL_LEAKS = (AUTH_PASSWORD, base64.b64encode(f"{AUTH_USER}:{AUTH_PASSWORD}".encode()).decode())


async def _rss_settled(pid: int, timeout: float = 60.0) -> None:
    """Wait until ``pid``'s VmRSS moves by under 2 % in half a second."""
    last = rss_bytes(pid) or 0

    async def steady() -> bool:
        nonlocal last
        await asyncio.sleep(0.5)
        now = rss_bytes(pid) or 0
        settled, last = abs(now - last) < last / 50, now
        return settled

    await wait_until_async(steady, timeout, f"QEMU {pid}'s resident memory to settle")


def scrape(port: int) -> Samples:
    status, headers, body = http_get(port, "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version="), (status, headers)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def counted(samples: Samples) -> Samples:
    """The series that count events: counters and histograms' counts."""
    return {k: v for k, v in samples.items() if k[0].endswith(("_total", "_count"))}


def key(name: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return name, tuple(sorted(labels.items()))


def audit_lines(log: str) -> list[dict[str, Any]]:
    found = []
    for line in log.splitlines():
        if line.startswith("{") and '"vmsidecar.audit"' in line:
            entry = json.loads(line)
            found.append(entry)
    return found


async def _captured(client: RuntimeClient) -> bool:
    return (await client.state()).snapshot.capture_seconds is not None


async def pulled_bytes(events: list[dict[str, Any]]) -> list[int]:
    return [e["data"]["bytes_downloaded"] for e in events if e["type"] == "pulled"]


async def test_a_lease_cycle_moves_every_counter_exactly_and_is_audited(
    start_runtime: Any, tiny_image: Any, auth_registry: RunningRegistry, oci_qcow2: Path, tmp_path: Path
) -> None:
    auth = auth_file(tmp_path / "auth.json", {auth_registry.host: (AUTH_USER, AUTH_PASSWORD)})
    flashed_ref = f"{auth_registry.host}/metrics/disk:1"
    assert oci_main(["push", str(oci_qcow2), flashed_ref, "--registry-auth", str(auth)]) == 0
    missing_ref = f"{auth_registry.host}/metrics/missing:1"
    holder_ref = f"{AUTH_USER}:{HOLDER_SECRET}@{auth_registry.host}/metrics/disk:1"
    disk = f"file:{tiny_image.disk}"
    rt, port = await health_runtime(start_runtime, None, cache=tmp_path / "cache",
                                    extra_args=["--allow-host-paths", str(Path(tiny_image.disk).parent)],
                                    env={"VMSIDECAR_REGISTRY_AUTH_FILE": str(auth),
                                         "VMSIDECAR_LEASE_REGISTRIES": f"{auth_registry.host}/metrics"})
    client = rt.client()
    async with collecting(client, ["pulled"]) as log:  # subscribed before anything pulls
        before = scrape(port)
        assert before[key("vmsidecar_phase", phase="Stopped")] == 1 and before[key("vmsidecar_generation")] == 0

        # boot: a file: pull, a cold boot that captures at Ready
        await client.put_spec({"image": disk, "memory": "256M"})
        await client.wait_ready(300)
        # Ready comes after the capture and its restore; the state says so
        await wait_until_async(lambda: _captured(client), 300, "the capture's figures in the state")
        # lease 1 (generation 0): a refused call, off and on (a cold boot: the overlay has its changes),
        # a flash from the registry, a failed pull, a reference with credentials in it, a dump
        assert (await client.claim()).generation == 0
        with pytest.raises(StateError):
            await client.put_spec({"image": disk, "memory": "300M"})
        await client.power("off")
        await client.power("on")
        await client.wait_ready(300)
        flashed = await client.flash_reference(flashed_ref, power_off=True)
        with pytest.raises(ImageError) as failed:
            await client.flash_reference(missing_ref)
        with pytest.raises(ImageError) as holder:
            await client.flash_reference(holder_ref)
        dumped = await client.dump(tmp_path / "dump.qcow2")
        state = await client.recycle(if_generation=0)
        assert state.phase.value == "Ready" and state.snapshot.boot == "restored", state
        # lease 2 (generation 1): claimed, recycled
        assert (await client.claim()).generation == 1
        state = await client.recycle(if_generation=1)
        assert state.phase.value == "Ready" and state.generation == 2
        (qemu,) = qemu_pids(str(rt.state))
        await _rss_settled(qemu)  # a restored guest's RSS grows as it touches its pages, then holds
        after = scrape(port)
        qemu_rss = rss_bytes(qemu)
    events = list(log)

    file_bytes, oci_bytes = await pulled_bytes(events)
    assert file_bytes > 0 and oci_bytes > 0, events
    expected = {
        key("vmsidecar_leases_claimed_total"): 2,
        key("vmsidecar_recycles_total", outcome="ok"): 2,
        key("vmsidecar_boots_total", kind="cold"): 2,
        key("vmsidecar_boots_total", kind="restored"): 2,
        key("vmsidecar_boot_to_ready_seconds_count", kind="cold"): 2,
        key("vmsidecar_boot_to_ready_seconds_count", kind="restored"): 2,
        key("vmsidecar_recycle_to_ready_seconds_count"): 2,
        key("vmsidecar_snapshot_capture_seconds_count"): 1,
        key("vmsidecar_snapshot_restore_seconds_count"): 2,
        key("vmsidecar_snapshot_lookups_total", result="miss", reason="none_cached"): 1,
        key("vmsidecar_snapshot_lookups_total", result="miss", reason="lease_changes"): 1,
        key("vmsidecar_snapshot_lookups_total", result="hit", reason="hit"): 2,
        key("vmsidecar_pull_bytes_total", source="file"): file_bytes,
        key("vmsidecar_pull_bytes_total", source="oci"): oci_bytes,
        key("vmsidecar_pull_seconds_count", source="file"): 1,
        key("vmsidecar_pull_seconds_count", source="oci"): 1,
        key("vmsidecar_flash_bytes_total", source="oci"): oci_bytes,
        key("vmsidecar_flash_seconds_count", source="oci"): 1,
        key("vmsidecar_dump_bytes_total"): dumped,
        key("vmsidecar_errors_total", code="wrong_phase"): 1,
        key("vmsidecar_errors_total", code=failed.value.code): 1,
        key("vmsidecar_errors_total", code=holder.value.code): 1 + (holder.value.code == failed.value.code),
    }
    console = key("vmsidecar_console_bytes_total")
    assert after[console] > before[console]  # what the guest printed: not known to the byte
    deltas = {k: v - before.get(k, 0) for k, v in counted(after).items() if k != console}
    assert {k: v for k, v in deltas.items() if v} == {k: v for k, v in expected.items() if v}
    assert set(counted(before)) == set(counted(after))  # every series existed before its first event
    assert after[key("vmsidecar_phase", phase="Ready")] == 1
    assert sum(v for k, v in after.items() if k[0] == "vmsidecar_phase") == 1
    assert after[key("vmsidecar_generation")] == 2
    # QEMU's own, not a figure of the runtime's (~60 MB, as much as a restored tiny QEMU's): within a
    # tenth of the VmRSS its /proc shows right after the scrape, once that has settled
    assert qemu_rss is not None and abs(after[key("vmsidecar_qemu_resident_memory_bytes")] - qemu_rss) < qemu_rss / 10
    assert after[key("vmsidecar_cache_size_bytes")] > before[key("vmsidecar_cache_size_bytes")]

    # the audit trail, line by line
    digest = state.image_digest
    base = f"{disk}@{digest}"
    lines = audit_lines(rt.log_text())
    summaries = [line for line in lines if line["audit"] == "lease"]
    calls = [(line["method"], line["generation"], line.get("action"), line["target"], line["outcome"])
             for line in lines if line["audit"] == "call"]
    assert calls == [
        ("PUT /v1/vm/spec", 0, None, disk, "ok"),
        ("POST /v1/vm/lease", 0, None, base, "ok"),
        ("PUT /v1/vm/spec", 0, None, disk, "wrong_phase"),
        ("POST /v1/vm/power", 0, "off", base, "ok"),
        ("POST /v1/vm/power", 0, "on", base, "ok"),
        ("POST /v1/vm/disk/pull", 0, None, f"{flashed_ref}@{flashed.image_digest}", "ok"),
        ("POST /v1/vm/disk/pull", 0, None, missing_ref, failed.value.code),
        ("POST /v1/vm/disk/pull", 0, None, f"{auth_registry.host}/metrics/disk:1", holder.value.code),
        ("GET /v1/vm/disk", 0, None, f"{flashed_ref}@{flashed.image_digest}", "ok"),
        ("POST /v1/vm/recycle", 0, None, base, "ok"),
        ("POST /v1/vm/lease", 1, None, base, "ok"),
        ("POST /v1/vm/recycle", 1, None, base, "ok"),
    ], calls
    recycles = [line for line in lines if line.get("method") == "POST /v1/vm/recycle"]
    assert [r["new_generation"] for r in recycles] == [1, 2]
    assert all(line["duration_s"] >= 0 for line in lines if line["audit"] == "call")
    for summary in summaries:
        assert summary.pop("duration_s") > 0
        summary.pop("time")
    assert summaries == [
        {"logger": "vmsidecar.audit", "audit": "lease", "generation": 0, "claimed": True, "ended_by": "recycle",
         "flashed": [f"{flashed_ref}@{flashed.image_digest}"], "flashes": 1, "power_operations": 2,
         "bytes_in": oci_bytes,
         "bytes_out": dumped},
        {"logger": "vmsidecar.audit", "audit": "lease", "generation": 1, "claimed": True, "ended_by": "recycle",
         "flashed": [], "flashes": 0, "power_operations": 0, "bytes_in": 0, "bytes_out": 0},
    ]
    # no credential in any log line: the pool's, nor one a lease holder wrote into a reference
    log = rt.log_text()
    assert not [leak for leak in POOL_LEAKS if leak in log]
    assert not [line for line in lines if HOLDER_SECRET in json.dumps(line)]
    assert HOLDER_SECRET not in log, [line for line in log.splitlines() if HOLDER_SECRET in line]


# -- the listener serves three paths, and nothing else ------------------------------------------

SERVED = {"/healthz", "/readyz", "/metrics"}
METHODS = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT", "PROPFIND", "get",
           "GET ", "G\x00T"]
PIECES = ["metrics", "healthz", "readyz", "v1", "vm", "spec", "..", ".", "", "%2e%2e", "%2f", "%00", "%2e",
          "metrics%2f", "METRICS", "Metrics", "metrics;x", "metrics.txt", "%6detrics", "\\..\\", "..%5c", "~",
          "api.sock", "%252e%252e", "é", "%c0%ae%c0%ae", "metrics ", "openapi.json", "debug", "admin"]


def raw_request(port: int, request: bytes) -> tuple[int | None, bytes]:
    """Send bytes as they are (no client library to normalise them); the status and the body."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    try:
        return int(head.split(b" ", 2)[1]), body
    except (IndexError, ValueError):
        return None, body  # the server closed without answering


def _random_target(rng: random.Random) -> str:
    path = "/" + "/".join(rng.choice(PIECES) for _ in range(rng.randint(0, 4)))
    if rng.random() < 0.15:
        path = "/" + path  # //metrics
    if rng.random() < 0.1:
        path += "?" + rng.choice(["x=1", "", "name[]=up", "%00"])
    if rng.random() < 0.05:
        path = f"http://127.0.0.1{path}"  # absolute form
    return path


async def test_a_fuzz_pass_finds_no_path_but_the_three(start_runtime: Any) -> None:
    _, port = await health_runtime(start_runtime)
    rng = random.Random(22)
    answered: dict[int, int] = {}
    for _ in range(600):
        method, target = rng.choice(METHODS), _random_target(rng)
        encoded = target.encode("utf-8", "surrogateescape") if rng.random() < 0.9 else target.encode("latin-1",
                                                                                                     "replace")
        status, body = raw_request(port, method.encode() + b" " + encoded + b" HTTP/1.1\r\nHost: x\r\n"
                                   b"Connection: close\r\n\r\n")
        answered[status or 0] = answered.get(status or 0, 0) + 1
        path = urlsplit(target).path
        if status == 200:
            # a 200 only for a GET of one of the three (aiohttp resolves dot segments first)
            assert method.strip() == "GET" and not urlsplit(target).query, (method, target)  # "GET  /x" is a GET
            assert posixpath.normpath(unquote(path)) in SERVED or path in SERVED, (method, target, body[:200])
        else:
            assert status in (None, 400, 404, 405, 431, 503), (method, target, status, body[:200])
            if status == 503:  # /readyz of a runtime with no guest: the one 5xx
                assert posixpath.normpath(unquote(path)) == "/readyz", (method, target)
    print(f"\nfuzz pass over the health listener: statuses {dict(sorted(answered.items()))}")
    assert answered.get(404, 0) > 300  # the pass mostly asked for paths that are not there


def test_a_lease_that_flashes_without_end_keeps_its_audit_summary_bounded() -> None:
    """Each flash added its reference (up to ~600 characters) to the lease's summary, kept in the
    runtime until the lease ended and written as one line: 100,000 flashes held 119 MiB and made a
    57 MiB audit line. The summary keeps the last flashes and counts them all."""
    from vmsidecar_runtime.controller.ledger import FLASHED_KEPT, LeaseLedger

    ledger = LeaseLedger()
    for n in range(100_000):
        ledger.flash(f"registry.example/{'r' * 200}/{n}:t@sha256:{'0' * 64}", 1)
    summary = ledger.summary(7, "recycle")
    assert summary["flashes"] == 100_000 and summary["bytes_in"] == 100_000
    assert len(summary["flashed"]) == FLASHED_KEPT and summary["flashed"][-1].endswith(f"/99999:t@sha256:{'0' * 64}")
    assert len(json.dumps(summary)) < 64 << 10
