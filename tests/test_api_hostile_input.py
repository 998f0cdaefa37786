"""Hostile and malformed API calls on a live runtime with a booting guest: each is a clear 4xx,
names no host file, and leaves the spec, the disk and the guest as they were."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

pytestmark = pytest.mark.timeout(300)

SECRET = b"vmsidecar-host-secret-0123456789\n" * 64


class Raw:
    """Raw HTTP over the runtime's Unix socket (no client-side validation in the way)."""

    def __init__(self, socket: Path) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(socket)),
                                             base_url="http://vmsidecar")

    async def call(self, method: str, path: str, **kw: Any) -> tuple[int, Any]:
        async with self.session.request(method, path, **kw) as resp:
            raw = await resp.read()
            try:
                return resp.status, json.loads(raw)
            except ValueError:
                return resp.status, raw


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """A host file no API caller may read (stands for /etc/shadow; root can read either)."""
    path = tmp_path / "host-secret"
    path.write_bytes(SECRET)
    return path


@pytest.fixture
async def live(start_runtime: Any, tiny_image: Any, tmp_path: Path) -> Any:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    spec = {"image": f"file:{tiny_image.disk}", "memory": "256M"}
    rt = await start_runtime(spec, extra_args=["--allow-host-paths", str(allowed)])
    raw = Raw(rt.socket)
    yield rt, raw, spec, allowed
    await raw.session.close()


async def _unchanged(rt: Any, raw: Raw, spec: dict[str, Any]) -> None:
    status, body = await raw.call("GET", "/v1/vm/spec")
    assert status == 200 and body["image"] == spec["image"] and body["memory"] == 256
    state = await rt.client().wait_ready(180)
    assert state.generation == 0 and state.boot == 1, "an invalid call touched the guest"
    assert (await raw.call("GET", "/healthz"))[0] == 200


async def test_no_host_path_through_the_api(live: Any, secret: Path, image_cache: Path) -> None:
    rt, raw, spec, allowed = live
    await rt.client().wait_ready(180)  # the spec's own image is in the cache now
    cached_before = sorted(p.name for p in image_cache.rglob("*") if not p.name.endswith(".part"))
    relative = os.path.relpath(secret, Path.cwd())
    refused = [
        {"image": f"file:{secret}"},
        {"image": f"file:{'../' * 12}{str(secret).lstrip('/')}"},
        {"image": f"file:{relative}"},
        {"image": f"file:{allowed}/../host-secret"},
        {"image": f"oci-layout:{secret.parent}"},
        {"image": spec["image"], "kernel": str(secret)},
        {"image": spec["image"], "kernel": "../../etc/shadow"},
        {"image": spec["image"], "kernel": "/boot/vmlinuz", "initrd": str(secret)},
    ]
    for body in refused:
        status, answer = await raw.call("PUT", "/v1/vm/spec", json=body)
        assert status == 400 and answer["error"] == "host_path_not_allowed", (body, answer)
        assert "--allow-host-paths" in answer["message"] and "j vm storage flash FILE" in answer["message"]

    # the lease holder's `flash oci://file:/…` (the driver forwards the reference): refused before any pull
    for ref in (f"file:{secret}", f"file:{'../' * 12}{str(secret).lstrip('/')}", f"oci-layout:{secret.parent}"):
        status, answer = await raw.call("POST", "/v1/vm/disk/pull", json={"reference": ref, "power_off": True})
        assert status == 400 and answer["error"] == "host_path_not_allowed", (ref, answer)
    await _unchanged(rt, raw, spec)
    assert sorted(p.name for p in image_cache.rglob("*") if not p.name.endswith(".part")) == cached_before, "a refused pull left a cache entry"

    # the dump is still the guest's disk, not the host file
    await rt.client().power("off", graceful=False)
    status, disk = await raw.call("GET", "/v1/vm/disk", params={"format": "raw"})
    assert status == 200 and SECRET[:64] not in disk

    # a symlink inside an allowed directory that points out of it is refused too
    (allowed / "link.qcow2").symlink_to(secret)
    status, answer = await raw.call("POST", "/v1/vm/disk/pull", json={"reference": f"file:{allowed}/link.qcow2"})
    assert status == 400 and answer["error"] == "host_path_not_allowed"


async def test_allowed_directory_and_the_exporters_own_spec(live: Any, tiny_image: Any) -> None:
    rt, raw, spec, allowed = live
    # the exporter re-sends the spec of its own config: the same path the runtime was started with
    status, _ = await raw.call("PUT", "/v1/vm/spec", json=spec)
    assert status == 200
    # an image under the administrator's --allow-host-paths directory is accepted
    (allowed / "guest.qcow2").write_bytes(tiny_image.disk.read_bytes())
    await rt.client().wait_ready(180)
    status, answer = await raw.call("POST", "/v1/vm/disk/pull",
                                    json={"reference": f"file:{allowed}/guest.qcow2", "power_off": True})
    assert status == 200, answer
    assert b'"type": "result"' in answer if isinstance(answer, bytes) else answer["type"] == "result"


@pytest.mark.parametrize("path", ["/v1/vm/spec", "/v1/vm/power", "/v1/vm/recycle", "/v1/vm/disk/pull"])
async def test_malformed_bodies_are_400_and_change_nothing(live: Any, path: str) -> None:
    rt, raw, spec, _ = live
    method = "PUT" if path == "/v1/vm/spec" else "POST"
    json_type = {"Content-Type": "application/json"}
    cases = [
        ({"data": b"\xff\xfe{}", "headers": json_type}, "not UTF-8"),
        ({"data": b"{}", "headers": {"Content-Type": "application/json; charset=klingon"}}, "charset"),
        ({"data": b"[" * 100_000, "headers": json_type}, "nests too deeply"),
    ]
    for kw, words in cases:
        status, answer = await raw.call(method, path, **kw)
        assert status == 400 and answer["error"] == "bad_request" and words in answer["message"], (kw, answer)
    await _unchanged(rt, raw, spec)


async def test_spec_bounds_and_empty_spec(live: Any) -> None:
    rt, raw, spec, _ = live
    for body, words in [
        ({**spec, "memory": 10**30}, "memory"),
        ({**spec, "memory": "2048T"}, "1 TiB limit"),
        ({**spec, "machine": "q35,memory-backend=x"}, "machine"),
        ({**spec, "gpio": [{"name": f"l{i}"} for i in range(300)]}, "gpio"),
        ({**spec, "image": "r.example/" + "a" * 5000}, "image"),
    ]:
        status, answer = await raw.call("PUT", "/v1/vm/spec", json=body)
        assert status == 400 and answer["error"] == "invalid_spec" and words in answer["message"], answer
    for kw in ({"data": b""}, {"json": {}}):
        status, answer = await raw.call("PUT", "/v1/vm/spec", **kw)
        assert status == 400 and "spec is empty" in answer["message"], answer
    await _unchanged(rt, raw, spec)


async def test_a_left_event_stream_does_not_hold_up_the_exit(start_runtime: Any) -> None:
    rt = await start_runtime(None)
    raw = Raw(rt.socket)
    async with raw.session.get("/v1/events", params={"types": "never-published"}) as resp:
        assert resp.status == 200
        assert b'"hello"' in await resp.content.readline()
    await raw.session.close()  # the client leaves; no event will ever match its filter
    await asyncio.sleep(0.2)
    started = time.monotonic()
    assert rt.stop(timeout=30) == 0
    assert time.monotonic() - started < 10, "SIGTERM waited for an event stream whose client had left"
