"""Fuzz what a lease holder names and what an image publisher writes (issue 19): flash/pull
references and the ``io.vmsidecar.*``/OCI annotations of the images they point to, against a live
runtime, through the raw API.

The schema-driven fuzz (``test_api_fuzz.py``) sends random strings; a reference parser refuses
nearly all of them at the first character. Here hypothesis builds references the way an attacker
would: real loopback registries (ours, a closed port, a server that speaks no HTTP), schemes,
userinfo, path traversal, percent-escapes, unicode, overlong parts, digests of every shape. And it
publishes real images to the real registry with hostile annotations (readiness regexes, sizes,
digests, disk types, titles) and pulls them.

Pass means: every answer is a documented status with a documented body, every stream ends in one
result or one error line with a registered code (no ``internal``), no call takes longer than its
bound, the runtime answers ``GET /v1/vm`` within a second after each call, and at the end it still
boots the guest. Traffic goes to this machine's loopback only: a generated reference whose host is
not loopback is never sent (the parser that decides it is the runtime's own).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
import string
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from fixtures.attack import loopback_server
from fixtures.openapi_check import VALIDATOR
from fixtures.registry import Crafter, RunningRegistry, make_qcow2
from vmsidecar_contract.errors import VmsidecarError, registry
from vmsidecar_runtime.oci.reference import is_loopback_host, parse_reference

pytestmark = pytest.mark.timeout(600)

#: a pull that ends on its own (refused, failed, or done on a small image) within this
CALL_BOUND_S = 30.0
#: GET /v1/vm after every fuzzed call
STATE_BOUND_S = 1.0
REF_EXAMPLES = 120
ANNOTATION_EXAMPLES = 40
DOCUMENT_EXAMPLES = 40
PULL = "/v1/vm/disk/pull"
ARTIFACT = "application/vnd.diskimage.qcow2"
T = TypeVar("T")
#: no shrinking: each example is a live call (a hang costs CALL_BOUND_S), and the failing input is
#: printed as it was
PHASES = (Phase.explicit, Phase.generate)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def not_http() -> contextlib.AbstractAsyncContextManager[int]:
    """A loopback server that answers every connection with garbage and hangs up: not a registry."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            await asyncio.wait_for(reader.read(4096), 2)
            writer.write(b"\x16\x03\x01garbage\r\n\r\n" * 64)
            await writer.drain()
        writer.close()

    return loopback_server(handle)


def references(hosts: list[str]) -> st.SearchStrategy[str]:
    """References as an attacker writes them: structured ones on our loopback hosts, and free text."""
    component = st.text(alphabet=string.ascii_lowercase + string.digits + "._-", min_size=1, max_size=40)
    hostile_part = st.sampled_from(["..", ".", "%2e%2e", "%2f", "..%2f..", "a/../../b", "\u202e", "x" * 300,
                                    "A", "a__b", "-a", "a-", "\x00", "%00", "a\nb", "€", "../../etc/passwd"])
    repo = st.lists(st.one_of(component, hostile_part), min_size=1, max_size=4).map("/".join)
    tag = st.one_of(st.none(), st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,20}", fullmatch=True),
                    st.sampled_from(["", "..", "x" * 129, "latest\n", "a:b", "%2e"]))
    digest = st.one_of(st.none(), st.from_regex(r"sha256:[0-9a-f]{64}", fullmatch=True),
                       st.sampled_from(["sha256:", "sha256:" + "0" * 63, "sha512:" + "a" * 128, "md5:abc",
                                        "sha256:" + "A" * 64, "sha256:../../x"]))
    prefix = st.sampled_from(["", "oci://", "docker://", "http://", "https://", "oci:", "file:", "oci-layout:",
                              "containers-storage:", "ftp://", "//", "user:secret@", "oci://user:secret@"])
    host = st.sampled_from(hosts)

    @st.composite
    def structured(draw: st.DrawFn) -> str:
        text = f"{draw(prefix)}{draw(host)}/{draw(repo)}"
        if (t := draw(tag)) is not None:
            text += f":{t}"
        if (d := draw(digest)) is not None:
            text += f"@{d}"
        return text

    free = st.text(min_size=1, max_size=200)
    return st.one_of(structured(), structured(), free)


def loopback_only(reference: str) -> bool:
    """Whether the runtime would talk to this machine only (or to no registry at all)."""
    try:
        ref = parse_reference(reference)
    except VmsidecarError:
        return True  # refused before any traffic
    except Exception:  # a crash of the parser is the runtime's bug: send it, the runtime must not 500
        return True
    return ref.kind != "registry" or is_loopback_host(ref.registry or "")


class Api:
    """Raw API calls over the Unix socket; every answer checked against the document."""

    def __init__(self, sock: Path) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(sock)),
                                             base_url="http://vmsidecar",
                                             timeout=aiohttp.ClientTimeout(total=CALL_BOUND_S))

    async def pull(self, reference: str) -> dict[str, Any]:
        """POST a pull; the stream's last line (result or error), after checking every line."""
        async with self.session.post(PULL, json={"reference": reference, "power_off": True}) as resp:
            raw = await resp.read()
            VALIDATOR.response("POST", PULL, resp.status, resp.headers, raw)
            if resp.status != 200:
                body = json.loads(raw)
                assert resp.status < 500, f"{reference!r}: {resp.status} {body}"
                return {"type": "error", **body}
            lines = [json.loads(line) for line in raw.splitlines() if line.strip()]
            assert lines and lines[-1]["type"] in ("result", "error"), f"{reference!r}: stream {lines[-3:]}"
            assert [x["type"] for x in lines[:-1]] == ["progress"] * (len(lines) - 1), lines
            return lines[-1]

    async def state(self) -> dict[str, Any]:
        async with self.session.get("/v1/vm") as resp:
            raw = await resp.read()
            VALIDATOR.response("GET", "/v1/vm", resp.status, resp.headers, raw)
            assert resp.status == 200
            return json.loads(raw)


class Fuzz:
    """Runs the fuzzed calls on the test's event loop from hypothesis' (sync) thread."""

    def __init__(self, api: Api, loop: asyncio.AbstractEventLoop) -> None:
        self.api, self.loop = api, loop
        self.outcomes: dict[str, int] = {}
        self.slowest = 0.0

    def run(self, coro: Awaitable[T], what: str) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]
        try:
            return future.result(CALL_BOUND_S + 10)
        except TimeoutError:
            future.cancel()
            raise AssertionError(f"no answer in {CALL_BOUND_S + 10:.0f} s to {what}") from None

    def pull(self, reference: str) -> dict[str, Any]:
        started = time.monotonic()
        last = self.run(self.api.pull(reference), f"a pull of {reference[:300]!r}")
        seconds = time.monotonic() - started
        self.slowest = max(self.slowest, seconds)
        assert seconds < CALL_BOUND_S, f"{reference!r} took {seconds:.1f} s"
        if last["type"] == "error":
            code = last["error"]
            assert code in registry(), f"{reference!r}: unregistered error code {code!r}: {last}"
            assert code != "internal", f"{reference!r}: internal error: {last}"
            assert last["message"].strip(), last
            self.outcomes[code] = self.outcomes.get(code, 0) + 1
        else:
            self.outcomes["ok"] = self.outcomes.get("ok", 0) + 1
        started = time.monotonic()
        self.run(self.api.state(), f"GET /v1/vm after a pull of {reference[:300]!r}")
        assert time.monotonic() - started < STATE_BOUND_S, f"GET /v1/vm was slow after {reference!r}"
        return last


def annotation_values() -> st.SearchStrategy[str]:
    return st.one_of(
        st.text(max_size=64),
        st.sampled_from(["(a|aa)+b", "(", "\\1", "(?P<x>a)(?P=x)", "x" * 5000, "0", "-1", "1e309", "nan",
                         "99999999999999999999999", "ttyS1", "../hvc0", "raw", "qcow2", "vmdk", "sha256:" + "0" * 64,
                         "sha256:", "/etc/passwd", "../../x", "\x00"]),
    )


ANNOTATION_KEYS = ["io.vmsidecar.readiness.pattern", "io.vmsidecar.readiness.console",
                   "io.vmsidecar.readiness.timeout", "io.vmsidecar.disk.digest", "io.vmsidecar.disk.size",
                   "org.opencontainers.image.title", "disktype", "io.vmsidecar.other", "io.vmsidecar."]


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)
#: where a mutation lands in a valid manifest (a key path; the last step is set to a fuzzed value)
MANIFEST_FIELDS = [("schemaVersion",), ("mediaType",), ("config",), ("config", "digest"), ("config", "size"),
                   ("layers",), ("layers", 0), ("layers", 0, "digest"), ("layers", 0, "size"),
                   ("layers", 0, "mediaType"), ("layers", 0, "annotations"), ("artifactType",), ("subject",),
                   ("manifests",), ("annotations",)]


def deep(depth: int) -> str:
    """A marker that :func:`serialize` turns into JSON nested ``depth`` levels (a parser that recurses
    per level must refuse it, not crash; Python's own json cannot even build it)."""
    return f"@@deep:{depth}@@"


def serialize(doc: Any) -> bytes:
    text = json.dumps(doc)
    for depth in (5000, 100_000):
        text = text.replace(json.dumps(deep(depth)), "[" * depth + "]" * depth)
    return text.encode()


def mutated(manifest: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    doc = json.loads(json.dumps(manifest))
    node: Any = doc
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = value
    return doc


def write_layout(root: Path, blobs: dict[str, bytes], manifest: bytes, media_type: Any) -> None:
    """An OCI layout whose index names ``manifest`` (tag ``x``) under ``media_type``."""
    (root / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (root / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    for data in [*blobs.values(), manifest]:
        (root / "blobs" / "sha256" / Crafter.digest(data)[7:]).write_bytes(data)
    entry = {"mediaType": media_type, "digest": Crafter.digest(manifest), "size": len(manifest),
             "annotations": {"org.opencontainers.image.ref.name": "x"}}
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [entry]}))


async def test_fuzzed_references_and_annotations(start_runtime: Any, tiny_image: Any, registry: RunningRegistry,
                                                 tmp_path: Path) -> None:
    layouts = tmp_path / "layouts"
    layouts.mkdir()
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M"},
                             extra_args=["--allow-host-paths", str(layouts)])
    client = rt.client()
    await client.wait_ready(240)
    await client.power("off", graceful=False)

    disk = make_qcow2(tmp_path / "small.qcow2")
    crafter = Crafter(registry=registry, repo="fuzz/annotated")
    layer = crafter.blob(disk.read_bytes(), "application/vnd.diskimage.qcow2")
    good = crafter.tag(crafter.manifest([layer], artifact_type=ARTIFACT), "good")

    api = Api(rt.socket)
    fuzz = Fuzz(api, asyncio.get_running_loop())
    tags = itertools.count()
    try:
        async with not_http() as garbage_port:
            hosts = [registry.host, f"localhost:{registry.host.rsplit(':', 1)[1]}", f"127.0.0.1:{_closed_port()}",
                     f"127.0.0.1:{garbage_port}", "[::1]:1", "127.0.0.1:0", "127.0.0.1:99999", "127.0.0.1:",
                     "127.1", "0x7f.0.0.1:80"]

            @settings(max_examples=REF_EXAMPLES, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck), phases=PHASES)
            @given(references(hosts).filter(loopback_only))
            def fuzz_references(reference: str) -> None:
                fuzz.pull(reference)

            @settings(max_examples=ANNOTATION_EXAMPLES, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck), phases=PHASES)
            @given(st.dictionaries(st.sampled_from(ANNOTATION_KEYS), annotation_values(), min_size=1, max_size=5),
                   st.sampled_from(["manifest", "layer", "index"]))
            def fuzz_annotations(notes: dict[str, str], where: str) -> None:
                # a fresh tag each example: the runtime must read the annotations of this very image
                tag = f"a{next(tags)}"
                if where == "layer":
                    desc = crafter.manifest([{**layer, "annotations": notes}],
                                            artifact_type=ARTIFACT)
                elif where == "manifest":
                    doc = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "artifactType": ARTIFACT,
                           "config": crafter.blob(b"{}", "application/vnd.oci.empty.v1+json"),
                           "layers": [layer], "annotations": notes}
                    desc = crafter._put_manifest(json.dumps(doc).encode(), doc["mediaType"])
                else:
                    inner = crafter.manifest([layer], artifact_type=ARTIFACT)
                    desc = crafter.index([(inner, {"architecture": "amd64", "os": "linux"}, notes)])
                fuzz.pull(crafter.tag(desc, tag))

            disk_bytes = disk.read_bytes()
            empty = b"{}"
            valid = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                     "artifactType": ARTIFACT,
                     "config": {"mediaType": "application/vnd.oci.empty.v1+json", "digest": Crafter.digest(empty),
                                "size": 2},
                     "layers": [{"mediaType": ARTIFACT, "digest": Crafter.digest(disk_bytes),
                                 "size": len(disk_bytes)}]}
            hostile_values = st.one_of(JSON, st.sampled_from([deep(5000), deep(100_000), "x" * 100_000, -1, 2**70,
                                                              1e308, {"$ref": "#"}, [valid] * 50]))

            @settings(max_examples=DOCUMENT_EXAMPLES, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck), phases=PHASES)
            @given(st.sampled_from(MANIFEST_FIELDS), hostile_values,
                   st.one_of(st.just("application/vnd.oci.image.manifest.v1+json"), JSON))
            def fuzz_documents(path: tuple[Any, ...], value: Any, index_media_type: Any) -> None:
                root = layouts / f"l{next(tags)}"
                manifest = serialize(mutated(valid, path, value))
                write_layout(root, {"empty": empty, "disk": disk_bytes}, manifest, index_media_type)
                try:
                    fuzz.pull(f"oci-layout:{root}:x")
                except AssertionError as e:
                    raise AssertionError(f"{e}\nmanifest ({len(manifest)} bytes): {manifest[:300]!r}…"
                                         f"{manifest[-100:]!r}\nindex mediaType: {index_media_type!r}") from None

            await asyncio.to_thread(fuzz_references)
            await asyncio.to_thread(fuzz_annotations)
            await asyncio.to_thread(fuzz_documents)
    finally:
        await api.session.close()

    total = sum(fuzz.outcomes.values())
    print(f"\nreference/annotation fuzz: {total} pulls, slowest {fuzz.slowest:.1f} s, outcomes "
          f"{dict(sorted(fuzz.outcomes.items()))}")
    assert total >= REF_EXAMPLES // 2 + ANNOTATION_EXAMPLES // 2 + DOCUMENT_EXAMPLES // 2
    assert fuzz.outcomes.get("ok", 0) >= 1, "no fuzzed pull succeeded: the fuzz never reached the install path"
    assert len(fuzz.outcomes) >= 3, f"the fuzz hit too few outcomes to mean anything: {fuzz.outcomes}"

    # the runtime still works: the known-good image installs and the original spec boots again
    assert (await Api(rt.socket).pull(good))["type"] == "result"
    await client.recycle()  # back to the spec's image, booted
    state = await client.wait_ready(240)
    assert state.phase.value == "Ready"

