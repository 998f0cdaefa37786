"""The exporter's own metrics (issue 22): leases served, driver calls by method and outcome, lease
durations, served by the single-process exporter (``--metrics-listen``) at ``GET /metrics`` only.

The deltas are asserted through real ``jmp`` leases against the in-test controller, on a real guest,
scraped with ``prometheus_client``'s own parser."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import inspect
import socket
import subprocess
import time
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fixtures.jmp import RUNNER, VM_TYPE, exporter_config, jmp_env, start_runner
from fixtures.ports import free_port
from fixtures.waiting import wait_until, wait_until_async
from jumpstarter_driver_vmsidecar.metrics import _exported_as
from jumpstarter_driver_vmsidecar.metrics_http import MAX_CLIENTS, parse_listen

METRIC_NAMES = {"vmsidecar_exporter_leases_total", "vmsidecar_exporter_driver_calls_total",
                "vmsidecar_exporter_lease_duration_seconds_count", "vmsidecar_exporter_lease_duration_seconds_sum"}

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _get(port: int, path: str, method: str = "GET") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, headers={"Connection": "close"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def scrape(port: int) -> Samples:
    """Every sample of the exporter's metrics, keyed by (name, sorted labels)."""
    status, body = _get(port, "/metrics")
    assert status == 200, body
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode())
            for s in family.samples if s.name in METRIC_NAMES}


def deltas(before: Samples, after: Samples) -> dict[str, float]:
    """Samples that changed, as ``name{label=value,…}`` → change (series new since ``before`` count from 0)."""
    changed = {}
    for key, value in after.items():
        if value != before.get(key, 0.0):
            name, labels = key
            changed[name + "{" + ",".join(f"{k}={v}" for k, v in labels) + "}"] = value - before.get(key, 0.0)
    return changed


def _driver_classes() -> list[type]:
    eps = entry_points(group="jumpstarter.drivers")
    return [ep.load() for ep in eps if ep.value.startswith("jumpstarter_driver_vmsidecar.")]


def test_every_exported_method_of_every_driver_is_counted_and_keeps_its_kind() -> None:
    classes = _driver_classes()
    assert len(classes) >= 8
    for cls in classes:
        for name in dir(cls):
            func = getattr(cls, name)
            if _exported_as(func) is None:
                continue
            assert getattr(func, "__vmsidecar_metered__", False), f"{cls.__name__}.{name} is not metered"
            inner = func.__wrapped__  # one level: the method as written
            # jumpstarter dispatches on the kind: awaited, iterated, run in a thread or entered
            assert inspect.iscoroutinefunction(func) == inspect.iscoroutinefunction(inner), name
            assert inspect.isasyncgenfunction(func) == inspect.isasyncgenfunction(inner), name
            assert _exported_as(func) == _exported_as(inner), name


def test_listen_address_errors_name_the_flag_and_the_form() -> None:
    assert parse_listen("127.0.0.1:8082") == ("127.0.0.1", 8082)
    assert parse_listen("[::1]:0") == ("::1", 0)
    for bad in ("8082", "localhost:8082", "127.0.0.1:70000", ":8082"):
        with pytest.raises(ValueError, match=r"--metrics-listen .* is not HOST:PORT .*VMSIDECAR_EXPORTER_METRICS_LISTEN"):
            parse_listen(bad)


def test_a_port_in_use_stops_the_runner_with_the_reason(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cfg = tmp_path / "exporter.yaml"
        cfg.write_text("apiVersion: jumpstarter.dev/v1alpha1\nkind: ExporterConfig\nendpoint: ''\ntoken: ''\n")
        out = subprocess.run([*RUNNER, "--exporter-config", str(cfg), "--metrics-listen", f"127.0.0.1:{port}"],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out
    assert f"cannot serve metrics on 127.0.0.1:{port} (Address already in use); pick a free port" in out.stderr


async def test_leases_and_driver_calls_through_real_jmp_leases(
    start_runtime: Any, tiny_image: Any, jmpctl: Any, tmp_path: Path
) -> None:
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M"})
    await rt.client().wait_ready(180)
    cfg = jmpctl.exporter_config({"vm": {"type": VM_TYPE, "config": {"socket": str(rt.socket),
                                                                       "recycle": "InPlaceReuse"}}})
    port = free_port()
    log = tmp_path / "runner.log"
    # the env var, as a pod sets it (the flag is tested above)
    proc = start_runner(["--exporter-config", str(cfg)], jmpctl.env(VMSIDECAR_EXPORTER_METRICS_LISTEN=f"127.0.0.1:{port}"),
                  log)
    try:
        await asyncio.to_thread(jmpctl.wait_status, "vm", "AVAILABLE", 60)
        before = scrape(port)
        assert before[("vmsidecar_exporter_leases_total", ())] == 0  # the start-up tree is no lease
        scripts = [
            # lease 1: a reading, and a pull that fails (nothing listens on port 1)
            "j vm power read\nj vm storage flash oci://127.0.0.1:1/none:1 && exit 10 || true\n",
            # lease 2: two readings
            "j vm power read\nj vm power read\n",
        ]
        count = ("vmsidecar_exporter_lease_duration_seconds_count", ())
        held = 0.0  # LEASE_READY → release, per lease: within its claim → session end
        window = 0.0  # lease created → its duration observed, per lease: around it
        for n, script in enumerate(scripts, 1):
            since = time.monotonic()
            with jmpctl.lease("vm") as lease:
                ready = await asyncio.to_thread(jmpctl.wait_status, "vm", "LEASE_READY", 60, since)
                result = await asyncio.to_thread(subprocess.run, lease.argv("bash", "-ec", script), env=lease.env,
                                                 capture_output=True, text=True, timeout=180)
                assert result.returncode == 0, result.stderr[-2000:] + log.read_text(errors="replace")[-2000:]
                assert n != 1 or "registry 127.0.0.1:1 is unreachable" in result.stderr, result.stderr[-2000:]
            held += lease.released_at - ready
            # a lease's duration is observed when its session closes, which jumpstarter does after it reported
            # AVAILABLE (its session server's 1 s grace)
            after = await wait_until_async(lambda n=n: (a := scrape(port))[count] - before[count] == n and a, 30,
                                           f"lease {n}'s session to close", interval=0.25)
            window += time.monotonic() - since
    finally:
        proc.terminate()
        await asyncio.to_thread(proc.wait, 60)

    changed = deltas(before, after)
    duration = changed.pop("vmsidecar_exporter_lease_duration_seconds_sum{}")
    assert held < duration < window  # from each lease's claim to its session's end
    assert changed == {
        "vmsidecar_exporter_leases_total{}": 2,
        "vmsidecar_exporter_lease_duration_seconds_count{}": 2,
        "vmsidecar_exporter_driver_calls_total{method=VmPower.read,outcome=ok}": 3,
        "vmsidecar_exporter_driver_calls_total{method=VmStorage.flash_oci,outcome=error}": 1,
    }, log.read_text(errors="replace")[-3000:]


def test_the_listener_serves_metrics_only(tmp_path: Path) -> None:
    """Another path 404, another method 405, and idle connections past MAX_CLIENTS cost nothing."""
    cfg = exporter_config(tmp_path / "exporter.yaml", {"socket": str(tmp_path / "none.sock")})
    port = free_port()
    proc = start_runner(["--exporter-config", str(cfg), "--tls-grpc-listener", f"127.0.0.1:{free_port()}",
                   "--tls-grpc-insecure", "--metrics-listen", f"127.0.0.1:{port}"], jmp_env(), tmp_path / "log")
    try:
        def serving() -> tuple[int, bytes] | None:
            assert proc.poll() is None, (tmp_path / "log").read_text()
            with contextlib.suppress(OSError):
                return _get(port, "/metrics")
            return None

        status, body = wait_until(serving, 60, "the exporter's metrics listener", interval=0.2)
        assert status == 200 and b"# TYPE vmsidecar_exporter_leases_total counter" in body, (status, body.decode())

        # the listener serves before the session's driver tree is built; standalone TCP mode's one tree
        # counts as the process's one lease (docs/operations.md) once it is: 0, then 1, never more
        def counted() -> bool:
            value = scrape(port)[("vmsidecar_exporter_leases_total", ())]
            assert value in (0, 1), value
            return value == 1

        wait_until(counted, 60, "the standalone session counted as one lease", interval=0.2)
        for path in ("/", "/metrics/", "/metrics?x=1", "/healthz", "/../metrics", "//metrics"):
            assert _get(port, path)[0] == 404, path
        for method in ("POST", "PUT", "DELETE", "HEAD", "OPTIONS"):
            assert _get(port, "/metrics", method)[0] == 405, method
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(MAX_CLIENTS + 4)]
        try:
            time.sleep(0.5)  # the server tells no one when it has taken the idle clients: give it the time
            with pytest.raises(OSError):  # the slots are full: a new connection is closed at once
                _get(port, "/metrics")
        finally:
            for s in idle:
                s.close()
        def answered() -> bool:
            with contextlib.suppress(OSError):
                return _get(port, "/metrics")[0] == 200
            return False

        wait_until(answered, 15, "a slot back once the idle clients went away", interval=0.2)
    finally:
        proc.terminate()
        proc.wait(60)
