"""Fuzz the live API from its OpenAPI document (issue 13): schemathesis 4, over a TCP bridge to
``api.sock``, against a runtime serving a booted tiny guest.

Two runs, deterministic seed: first invalid requests only (the guest must not notice them: same
boot, same generation, still Ready), then valid and invalid ones mixed. Pass means: no check
fails (no 5xx but /readyz's documented 503, no undocumented status, Content-Type or body, invalid
data refused, 405 with Allow, NDJSON lines as documented), no request hangs past
``REQUEST_TIMEOUT_S``, at least ``MIN_REQUESTS`` requests, every answer also passes the tests'
own validator, and afterwards the runtime serves, boots the guest again and exits on SIGTERM.

What the fuzz may not call as generated (``api_fuzz_hooks.py``, config below): ``POST
/v1/shutdown`` ends the runtime by design (its refusals are checked here directly); an event
stream without ``timeout`` and a graceful power-off of up to an hour are valid but long, so their
waits are shortened, not removed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest
from multidict import CIMultiDict

from fixtures.attack import loopback_server
from fixtures.openapi_check import DOC_PATH, VALIDATOR

pytestmark = pytest.mark.timeout(900)

HOOKS = Path(__file__).with_name("api_fuzz_hooks.py")
SEED = 13
#: examples per operation in each generating phase (coverage adds its own boundary cases)
MAX_EXAMPLES = {"negative": 15, "all": 25}
MIN_REQUESTS = 500
#: a request that takes longer has hung: schemathesis reports it as an error
REQUEST_TIMEOUT_S = 30.0
#: a whole schemathesis run (it takes ~1 min here, under TCG with other guests running)
RUN_TIMEOUT_S = 420.0
#: positive_data_acceptance: valid data is refused by phase (409), host-path rules (400) or a bad
#: image (422) by design; the auth checks: the socket's file mode is the access control; the
#: resource checks need links between operations, which this API does not declare
EXCLUDED_CHECKS = ("positive_data_acceptance", "ignored_auth", "object_level_authorization", "use_after_free",
                   "ensure_resource_availability")
CONFIG = f"""
hooks = "{HOOKS}"

[[operations]]
include-path = "/readyz"
checks.not_a_server_error.expected-statuses = ["2xx", "3xx", "4xx", "503"]

[[operations]]
include-path = "/v1/shutdown"
enabled = false
"""
#: operations whose 2xx changes the guest (a valid call the fuzz may make)
GUEST_CHANGING = {("POST", "/v1/vm/power"), ("POST", "/v1/vm/recycle"), ("POST", "/v1/vm/lease"),
                  ("PUT", "/v1/vm/disk"), ("POST", "/v1/vm/disk/pull"), ("PUT", "/v1/vm/spec")}


@contextlib.asynccontextmanager
async def tcp_bridge(socket: Path) -> AsyncIterator[int]:
    """127.0.0.1:PORT forwarded byte for byte to the Unix socket (schemathesis speaks TCP only)."""

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_unix_connection(str(socket))
        except OSError:
            writer.close()
            return
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async with loopback_server(handle) as port:
        yield port


async def schemathesis_run(port: int, workdir: Path, mode: str) -> tuple[dict[str, Any], list[dict[str, Any]], str]:
    """One ``schemathesis run``: its JSON report, its HAR entries (every request) and its output."""
    workdir.mkdir(parents=True)
    config = workdir / "schemathesis.toml"
    config.write_text(CONFIG)
    argv = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "--no-color",
            "run", str(DOC_PATH), "--url", f"http://127.0.0.1:{port}", "--mode", mode,
            "--phases", "coverage,fuzzing", "--max-examples", str(MAX_EXAMPLES[mode]), "--seed", str(SEED),
            "--workers", "1", "--generation-database", "none", "--request-timeout", str(REQUEST_TIMEOUT_S),
            "--checks", "all", "--exclude-checks", ",".join(EXCLUDED_CHECKS),
            "--report", "json,har", "--report-dir", str(workdir / "report")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("VMSIDECAR_")}
    proc = await asyncio.create_subprocess_exec(*argv, cwd=workdir, env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), RUN_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        pytest.fail(f"schemathesis ({mode}) did not finish in {RUN_TIMEOUT_S:.0f} s: a request hangs")
    text = out.decode(errors="replace")
    reports = workdir / "report"
    [json_report], [har] = sorted(reports.glob("json-*.json")), sorted(reports.glob("har-*.json"))
    return json.loads(json_report.read_text()), json.loads(har.read_text())["log"]["entries"], text


def check_entries(entries: list[dict[str, Any]]) -> list[str]:
    """Every answer the fuzz got, through the tests' own validator too (status, Content-Type, body)."""
    problems = []
    for entry in entries:
        request, response = entry["request"], entry["response"]
        headers = CIMultiDict((h["name"], h["value"]) for h in response["headers"])
        content = response.get("content", {})
        body = None if content.get("encoding") == "base64" else content.get("text", "").encode()
        try:
            VALIDATOR.response(request["method"], urlsplit(request["url"]).path, response["status"], headers, body)
        except AssertionError as e:
            problems.append(str(e))
    return problems


def summary(entries: list[dict[str, Any]]) -> collections.Counter[tuple[str, str, int]]:
    return collections.Counter((e["request"]["method"], urlsplit(e["request"]["url"]).path, e["response"]["status"])
                               for e in entries)


def assert_passed(mode: str, report: dict[str, Any], entries: list[dict[str, Any]], output: str) -> None:
    assert report["exit_code"] == 0 and not report["failures"] and not report["errors"], (
        f"schemathesis ({mode}) found failures:\n{output[-12000:]}")
    operations = sum(len(ops) for ops in VALIDATOR.doc["paths"].values()) - 1  # all but POST /v1/shutdown
    assert report["operations"]["tested"] == operations and report["stop_reason"] == "completed", report
    problems = check_entries(entries)
    assert not problems, "\n".join(problems[:20])
    statuses = {s for _, _, s in summary(entries)}
    assert not {s for s in statuses if s >= 500} - {503}, f"server errors: {summary(entries)}"


def changed_guest(entries: list[dict[str, Any]]) -> list[str]:
    """The fuzz's valid calls that change the guest (2xx on a guest-changing operation)."""
    return [f"{e['request']['method']} {urlsplit(e['request']['url']).path}" for e in entries
            if (e["request"]["method"], urlsplit(e["request"]["url"]).path) in GUEST_CHANGING
            and 200 <= e["response"]["status"] < 300]


async def test_fuzz_the_live_api(start_runtime: Any, tiny_image: Any, tmp_path: Path) -> None:
    spec = {"image": f"file:{tiny_image.disk}", "memory": "256M"}
    # the tiny image's own directory is allowed, so the test can put the spec back after the fuzz
    rt = await start_runtime(spec, extra_args=["--allow-host-paths", str(tiny_image.disk.parent)])
    client = rt.client()
    before = await client.wait_ready(180)
    started = time.monotonic()
    async with tcp_bridge(rt.socket) as port:
        report, invalid_entries, output = await schemathesis_run(port, tmp_path / "negative", "negative")
        assert_passed("negative", report, invalid_entries, output)
        after_invalid = await client.state()
        # POST /v1/vm/lease has no input to make invalid: schemathesis sends it as is, and the first
        # claim of a generation only marks it claimed (a later one would recycle)
        valid = changed_guest(invalid_entries)
        assert valid in ([], ["POST /v1/vm/lease"]), f"valid calls in the invalid-only run: {valid}"
        assert (after_invalid.phase.value, after_invalid.boot, after_invalid.generation) == (
            "Ready", before.boot, before.generation), "invalid calls changed the guest"

        report, entries, output = await schemathesis_run(port, tmp_path / "all", "all")
        assert_passed("all", report, entries, output)
    seconds = time.monotonic() - started
    all_entries = invalid_entries + entries
    counts = summary(all_entries)
    print(f"\nfuzz: {len(all_entries)} requests in {seconds:.0f} s "
          f"({len(invalid_entries)} invalid-only, {len(entries)} mixed), slowest "
          f"{max(e['time'] for e in all_entries) / 1000:.1f} s; statuses "
          f"{dict(sorted(collections.Counter(s for (_, _, s), n in counts.items() for _ in range(n)).items()))}")
    for key, n in sorted(counts.items()):
        print(f"  {key[0]:7} {key[1]:18} {key[2]}  x{n}")
    assert len(all_entries) >= MIN_REQUESTS, f"only {len(all_entries)} requests were generated"

    # the runtime still serves; the guest was changed only by the valid calls the fuzz made
    state = await client.state()
    valid_changes = changed_guest(entries)
    print(f"  guest-changing valid calls: {collections.Counter(valid_changes)}; "
          f"now {state.phase.value}, boot {state.boot}, generation {state.generation}")
    if not valid_changes:
        assert (state.phase.value, state.boot, state.generation) == ("Ready", before.boot, before.generation)
    else:  # whatever the valid calls left, the guest boots again from the original spec
        await client.power("off", graceful=False)
        await client.put_spec(spec)
        await client.power("on")
        state = await client.wait_ready(180)
        assert state.boot > before.boot

    # the one excluded operation: its refusals (a stray method, an unknown parameter) leave it running
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(rt.socket)),
                                     base_url="http://vmsidecar") as http:
        for method, params, status in (("GET", None, 405), ("POST", {"now": "1"}, 400)):
            async with http.request(method, "/v1/shutdown", params=params) as resp:
                VALIDATOR.response(method, "/v1/shutdown", resp.status, resp.headers, await resp.read())
                assert resp.status == status
    assert (await client.state()).phase.value == "Ready"

    stop_started = time.monotonic()
    assert rt.stop(timeout=60) == 0
    stop_seconds = time.monotonic() - stop_started
    print(f"  SIGTERM -> exit 0 in {stop_seconds:.1f} s")
    assert stop_seconds < 30, f"SIGTERM took {stop_seconds:.1f} s after the fuzz"
