"""Hostile and malformed API calls on a live runtime with a booting guest: each is a clear 4xx,
names no host file, and leaves the spec, the disk and the guest as they were."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from fixtures.openapi_check import VALIDATOR
from vmsidecar_runtime.api.server import MAX_JSON_BODY

pytestmark = pytest.mark.timeout(300)

SECRET = b"vmsidecar-host-secret-0123456789\n" * 64


@pytest.fixture
def image_cache(request: pytest.FixtureRequest, tmp_path: Path, image_cache: Path) -> Path:
    """The session's shared cache (the guest is restored from its capture), except for a test marked
    ``own_cache``: it compares the cache's entries before and after, and another xdist worker's
    pulls and captures would be among them."""
    return tmp_path / "cache" if request.node.get_closest_marker("own_cache") else image_cache


class Raw:
    """Raw HTTP over the runtime's Unix socket: requests go as they are (invalid on purpose), every
    answer is checked against the document (``fixtures.openapi_check``)."""

    def __init__(self, socket: Path) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(socket)),
                                             base_url="http://vmsidecar")

    async def call(self, method: str, path: str, **kw: Any) -> tuple[int, Any]:
        async with self.session.request(method, path, **kw) as resp:
            raw = await resp.read()
            VALIDATOR.response(method, path, resp.status, resp.headers, raw)
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


@pytest.mark.own_cache
async def test_no_host_path_through_the_api(live: Any, secret: Path, image_cache: Path) -> None:
    rt, raw, spec, allowed = live
    await rt.client().wait_ready(180)  # the spec's own image is in the cache now
    await rt.client().wait_stored()  # and the snapshot its first Ready captured
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
    # paths no file system call should see: another user's home, a NUL byte, a name past NAME_MAX
    for body in ({"image": "file:~nosuchuser/d.qcow2"}, {"image": "~nosuchuser/d.qcow2"},
                 {"image": "file:/x\u0000y"}, {"image": spec["image"], "kernel": "/boot/vm\u0000linuz"},
                 {"image": "file:/" + "a" * 300}, {"image": spec["image"], "kernel": "/" + "a" * 300}):
        status, answer = await raw.call("PUT", "/v1/vm/spec", json=body)
        refusals = ("host_path_not_allowed", "bad_reference", "invalid_spec")
        assert status == 400 and answer["error"] in refusals, (body, answer)
    for ref in ("file:~nosuchuser/d", "file:/x\u0000y", "file:/" + "a" * 300):
        pull = {"reference": ref, "power_off": True}
        status, answer = await raw.call("POST", "/v1/vm/disk/pull", json=pull)
        assert status == 400, (ref, answer)

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
        # more digits than Python converts: a ValueError of its own, not a JSONDecodeError
        ({"data": b'{"timeout": ' + b"1" * 4301 + b"}", "headers": json_type}, "not a request"),
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
    async with raw.session.get("/v1/events", params={"types": "guest.panicked"}) as resp:
        assert resp.status == 200
        assert b'"hello"' in await resp.content.readline()
    await raw.session.close()  # the client leaves (its socket is closed now); no event will ever match its filter
    started = time.monotonic()
    assert rt.stop(timeout=30) == 0
    assert time.monotonic() - started < 10, "SIGTERM waited for an event stream whose client had left"


JSON = {"Content-Type": "application/json"}


async def test_bodies_must_be_declared_json_and_small(live: Any) -> None:
    """415 for a body that does not say it is JSON (found by the fuzzer: such bodies were parsed),
    413 naming the limit for one over it; none of them reaches the guest."""
    rt, raw, spec, _ = live
    await rt.client().wait_ready(180)
    for kw in ({"data": b'{"action": "off"}'},  # aiohttp sends no Content-Type for bytes
               {"data": b'{"action": "off"}', "headers": {"Content-Type": "text/plain"}},
               {"data": b"action=off", "headers": {"Content-Type": "application/x-www-form-urlencoded"}}):
        status, answer = await raw.call("POST", "/v1/vm/power", **kw)
        assert status == 415 and answer["error"] == "http_error", (kw, answer)
        assert "Content-Type: application/json" in answer["message"], answer
    status, answer = await raw.call("PUT", "/v1/vm/spec", data=b" " * (MAX_JSON_BODY + 1), headers=JSON)
    assert status == 413 and answer["error"] == "http_error" and str(MAX_JSON_BODY) in answer["message"], answer
    status, answer = await raw.call("PUT", "/v1/vm/disk", params={"power_off": "true"}, data=b"{}", headers=JSON)
    assert status == 415 and "application/octet-stream" in answer["message"], answer
    # a body said to be compressed (aiohttp would inflate it as it reads, and fail mid-read on one
    # that does not inflate), JSON or a disk image alike
    gzip = {"Content-Encoding": "gzip"}
    octets = {"Content-Type": "application/octet-stream"}
    power = {"data": b'{"action": "off"}', "headers": {**JSON, **gzip}}
    disk = {"params": {"power_off": "true"}, "data": b"QFI\xfb" + bytes(60), "headers": {**octets, **gzip}}
    for method, path, kw in (("POST", "/v1/vm/power", power), ("PUT", "/v1/vm/disk", disk)):
        status, answer = await raw.call(method, path, **kw)
        assert status == 415 and "Content-Encoding" in answer["message"], (path, answer)
    await _unchanged(rt, raw, spec)


async def test_json_types_are_strict(live: Any) -> None:
    """0/1/"true" are not booleans, true is not a number, NaN is not JSON, a name ends at its last
    character (found by the fuzzer: each was accepted); none of them reaches the guest."""
    rt, raw, spec, _ = live
    await rt.client().wait_ready(180)
    for path, body, words in [
        ("/v1/vm/power", {"action": "off", "graceful": 0}, "graceful"),
        ("/v1/vm/power", {"action": "cycle", "graceful": "true"}, "graceful"),
        ("/v1/vm/power", {"action": "off", "timeout": True}, "timeout"),
        ("/v1/vm/recycle", {"boot": 0}, "boot"),
        ("/v1/vm/recycle", {"if_generation": True}, "if_generation"),
        ("/v1/vm/recycle", {"if_generation": "0"}, "if_generation"),
        ("/v1/vm/disk/pull", {"reference": "127.0.0.1:1/x:1", "power_off": 1}, "power_off"),
        ("/v1/vm/spec", {**spec, "virtio_console": 0}, "virtio_console"),
        ("/v1/vm/spec", {**spec, "network": {"enabled": "false"}}, "network.enabled"),
        ("/v1/vm/spec", {**spec, "channels": [{"name": "ab\n"}]}, "not a valid name"),
    ]:
        method = "PUT" if path == "/v1/vm/spec" else "POST"
        status, answer = await raw.call(method, path, json=body)
        assert status == 400 and words in answer["message"], (body, answer)
    status, answer = await raw.call("POST", "/v1/vm/power", data=b'{"action": "off", "timeout": NaN}', headers=JSON)
    assert status == 400 and "NaN is not a JSON number" in answer["message"], answer
    # 2.0 is a JSON integer (and what Jumpstarter's JSON makes of 2): accepted
    status, answer = await raw.call("POST", "/v1/vm/recycle", json={"if_generation": 99.0})
    assert status == 409 and answer["error"] == "generation_changed", answer
    await _unchanged(rt, raw, spec)


async def test_query_parameters_are_checked(live: Any) -> None:
    """An unknown or repeated query parameter is a 400 (found by the fuzzer: ignored, or the first
    one won), booleans are true/false only, a bad digest is refused before anything happens."""
    rt, raw, spec, _ = live
    await rt.client().wait_ready(180)
    for method, path, params, words in [
        ("GET", "/v1/vm", {"x-typo": "1"}, "takes no query parameters"),
        ("GET", "/v1/vm/disk", [("format", "raw"), ("format", "qcow2")], "given 2 times"),
        ("GET", "/v1/vm/disk", {"fromat": "raw"}, "it takes format"),
        ("PUT", "/v1/vm/disk", {"power_off": "1"}, "not a boolean"),
        ("PUT", "/v1/vm/disk", {"power_off": "true", "digest": "sha256:nope"}, "not a sha256 digest"),
        ("GET", "/v1/events", {"timeout": "0"}, "timeout"),
        ("GET", "/v1/events", {"timeout": "nan"}, "timeout"),
        ("POST", "/v1/shutdown", {"now": "1"}, "takes no query parameters"),
    ]:
        kw: dict[str, Any] = {"params": params}
        if method == "PUT":
            kw.update(data=b"not a disk", headers={"Content-Type": "application/octet-stream"})
        status, answer = await raw.call(method, path, **kw)
        assert status == 400 and answer["error"] == "bad_request" and words in answer["message"], (params, answer)
    await _unchanged(rt, raw, spec)  # the refused shutdown and power_off=true flash left it running


async def test_event_stream_with_timeout_ends_by_itself(start_runtime: Any) -> None:
    rt = await start_runtime(None)
    raw = Raw(rt.socket)
    started = time.monotonic()
    status, body = await raw.call("GET", "/v1/events", params={"timeout": "0.5"})
    assert status == 200 and isinstance(body, dict) and body["type"] == "hello"
    assert 0.4 < time.monotonic() - started < 10
    await raw.session.close()


async def test_the_api_tells_nothing_of_which_host_files_exist(start_runtime: Any) -> None:
    """A reference over the API was classified by looking at the host: ``etc/passwd`` (relative to
    the runtime's working directory, ``/`` in its image) that exists was refused as a host path,
    one that does not as "no registry host"; ``~root/x`` answered with root's home and ``~nosuch/x``
    said that no such user exists. Both of each pair now get the same answer."""
    from vmsidecar_contract.errors import VmsidecarError

    rt = await start_runtime({"memory": "256M"})
    # a file in the runtime's working directory (the test's, which it inherits), named relatively
    here = next(p.name for p in sorted(Path.cwd().iterdir()) if p.is_file() and p.name[0].isalpha())

    async def answer(ref: str) -> tuple[str, str]:
        with pytest.raises(VmsidecarError) as refused:
            await rt.client().flash_reference(ref, power_off=True)
        return refused.value.code, refused.value.message.replace(ref, "REF")

    assert await answer(here) == await answer(here + "-absent")
    assert await answer("~root/x") == await answer("~nosuchuser-vmsidecar/x")
    assert "/root" not in (await answer("~root/x"))[1]
