"""A hostile registry's answers: well-formed HTTP whose JSON has the wrong shapes, headers no client
expects, or nesting hidden from the depth guard. Each is a refusal naming the image (``ImageError``),
and for a snapshot source a refusal the pod boots cold after (``SourceRefused``), never another
exception type: one of those was a 500 from the API, a pull stream cut without its error line, or a
power-on left in Starting with no QEMU. A push reads one answer too, the index under the tag it
merges its entry into: the same refusal, naming the tag.

A stand-in registry serves the crafted answers: distribution 2.8 validates what it is pushed and
would store none of them, and a hostile registry is exactly a server that answers so.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
from test_attack_credentials import FakeRegistry

from vmsidecar_contract.errors import ImageError
from vmsidecar_contract.spec import VmSpec
from vmsidecar_runtime.disk import DiskImage
from vmsidecar_runtime.oci.mediatypes import (
    OCI_INDEX,
    OCI_MANIFEST,
    SNAPSHOT_ARTIFACT_TYPE,
    SNAPSHOT_FILE,
    load_document,
)
from vmsidecar_runtime.oci.pull import pull
from vmsidecar_runtime.oci.reference import parse_reference
from vmsidecar_runtime.oci.registry import RegistryClient
from vmsidecar_runtime.oci.snapshot_artifact import referrers_tag
from vmsidecar_runtime.oci.snapshot_fetch import SourceRefused, fetch_snapshot
from vmsidecar_runtime.oci.snapshot_push import _add_referrer
from vmsidecar_runtime.snapshot_identity import PREFIX, identify
from vmsidecar_runtime.snapshots import SnapshotStore

pytestmark = pytest.mark.timeout(120)

KEY = PREFIX + "key"

#: nesting 100000 deep hidden from a guard that reads the bytes as UTF-8: in UTF-16-LE the code unit
#: U+2200 is the bytes 00 22, a '"' to a bytes regex, which then swallows the real brackets
NESTED_UTF16 = ('{"a":"\u2200","b":' + "[" * 100_000 + '"').encode("utf-16-le")


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class StandIn:
    """Answers ``(status, headers, body)`` by path (``/v2/`` is 200, anything else 404), served by
    ``test_attack_credentials.FakeRegistry``: a real HTTP server whose answers are this function."""

    def __init__(self) -> None:
        self.answers: dict[str, tuple[int, dict[str, str], bytes]] = {}
        self.registry = FakeRegistry(answer=self._answer)
        self.host = self.registry.host

    def _answer(self, handler: BaseHTTPRequestHandler) -> None:
        path = handler.path.split("?")[0]
        status, headers, body = self.answers.get(path, (200, {}, b"{}") if path == "/v2/" else
                                                 (404, {"Content-Type": "application/json"},
                                                  b'{"errors":[{"code":"NOT_FOUND"}]}'))
        handler.send_response(status)
        for name, value in {"Content-Length": str(len(body)), **headers}.items():
            handler.send_header(name, value)
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(body)

    def manifest(self, repo: str, ref: str, doc: dict | bytes, media_type: str = OCI_MANIFEST,
                 headers: dict[str, str] | None = None, status: int = 200) -> str:
        body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
        digest = _digest(body)
        for name in (ref, digest):
            answer = {"Content-Type": media_type, "Docker-Content-Digest": digest, **(headers or {})}
            self.answers[f"/v2/{repo}/manifests/{name}"] = (status, answer, body)
        return digest

    def blob(self, repo: str, data: bytes, headers: dict[str, str] | None = None) -> dict:
        digest = _digest(data)
        self.answers[f"/v2/{repo}/blobs/{digest}"] = (200, {"Content-Type": "application/octet-stream",
                                                            **(headers or {})}, data)
        return {"mediaType": "application/vnd.diskimage.qcow2", "digest": digest, "size": len(data),
                "annotations": {"org.opencontainers.image.title": "disk.qcow2"}}


@pytest.fixture
def stand_in() -> Iterator[StandIn]:
    registry = StandIn()
    with registry.registry:
        yield registry


EMPTY = {"mediaType": "application/vnd.oci.empty.v1+json",
         "digest": "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a", "size": 2}


def _image(layers: list[dict], **extra: Any) -> dict:
    return {"schemaVersion": 2, "mediaType": OCI_MANIFEST,
            "artifactType": "application/vnd.vmsidecar.disk.v1", "config": EMPTY, "layers": layers, **extra}


def _index(manifests: Any, **extra: Any) -> dict:
    return {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": manifests, **extra}


def _entry(digest: str, **extra: Any) -> dict:
    return {"mediaType": OCI_MANIFEST, "digest": digest, "size": 10, **extra}


def _serve(case: str, reg: StandIn) -> None:
    """Put the crafted answer of ``case`` at ``repo:t``."""
    repo = "hostile"
    disk = reg.blob(repo, b"QFI\xfb" + bytes(508))
    good = reg.manifest(repo, "good", _image([disk]))
    if case == "platform-a-string":
        reg.manifest(repo, "t", _index([_entry(good, platform="linux/amd64")]), OCI_INDEX)
    elif case == "entry-annotations-a-list":
        reg.manifest(repo, "t", _index([_entry(good, annotations=["x"])]), OCI_INDEX)
    elif case == "manifests-a-number":
        reg.manifest(repo, "t", _index(5), OCI_INDEX)
    elif case == "layer-title-a-number":
        reg.manifest(repo, "t", _image([{**disk, "mediaType": "application/octet-stream",
                                          "annotations": {"org.opencontainers.image.title": 5}}]))
    elif case == "config-a-string":
        reg.manifest(repo, "t", _image([disk], config="x"))
    elif case == "disk-size-superscript":
        reg.manifest(repo, "t", _image([{**disk, "annotations": {**disk["annotations"],
                                                                 "io.vmsidecar.disk.size": "\u00b2"}}]))
    elif case == "nested-utf16":
        reg.manifest(repo, "t", NESTED_UTF16)
    elif case == "blob-length-superscript":
        reg.blob(repo, b"QFI\xfb" + bytes(508), {"Content-Length": "\u00b2"})
        reg.manifest(repo, "t", _image([disk]))
    elif case == "auth-realm-bad-url":
        realm = {"Www-Authenticate": 'Bearer realm="http://[x/token"'}
        reg.answers[f"/v2/{repo}/manifests/t"] = (401, realm, b"")
    elif case == "errors-a-number":
        reg.answers[f"/v2/{repo}/manifests/t"] = (404, {"Content-Type": "application/json"}, b'{"errors":5}')
    else:
        raise AssertionError(case)


CASES = ["platform-a-string", "entry-annotations-a-list", "manifests-a-number", "layer-title-a-number",
         "config-a-string", "disk-size-superscript", "nested-utf16", "blob-length-superscript",
         "auth-realm-bad-url", "errors-a-number"]


@pytest.mark.parametrize("case", CASES)
def test_a_hostile_registrys_answer_is_an_image_error_naming_what_it_read(stand_in: StandIn, case: str,
                                                                         tmp_path: Path) -> None:
    _serve(case, stand_in)
    with pytest.raises(ImageError) as refused:
        pull(f"{stand_in.host}/hostile:t", tmp_path / "cache", arch="x86_64", plain_http=True)
    message = refused.value.message
    assert "hostile" in message or "manifest sha256:" in message, message
    assert not list((tmp_path / "cache").rglob("*.qcow2")), "nothing of it is kept"


def test_the_depth_guard_reads_a_document_as_the_parser_does() -> None:
    with pytest.raises(ValueError):
        load_document(NESTED_UTF16)
    assert load_document('{"a": ["\u00e9"]}'.encode()) == {"a": ["\u00e9"]}


@pytest.mark.parametrize("case", ["nested-utf16", "manifests-a-number", "auth-realm-bad-url"])
def test_a_snapshot_source_answering_so_is_a_refusal_not_another_exception(stand_in: StandIn, case: str,
                                                                              tmp_path: Path) -> None:
    """The snapshot source's referrers (the tag schema: distribution 2.8 has no referrers API) answer
    with the same junk: a refusal with its reason, which the controller follows with a cold boot."""
    subject = _digest(b"the image's manifest")
    base = DiskImage(tmp_path / "d.qcow2", "qcow2", "sha256:" + "0" * 64, f"{stand_in.host}/hostile:1",
                     manifest_digest=subject)
    identity = identify(VmSpec.model_validate({"image": f"{stand_in.host}/hostile:1"}), base, "tcg")
    _serve(case, stand_in)
    crafted = stand_in.answers["/v2/hostile/manifests/t"]
    stand_in.answers[f"/v2/snaps/manifests/{referrers_tag(subject)}"] = crafted
    with pytest.raises(SourceRefused) as refused:
        fetch_snapshot(f"{stand_in.host}/snaps", identity, base, SnapshotStore(tmp_path / "cache"),
                       deadline=time.monotonic() + 60)
    assert refused.value.message, refused.value


class _Accepting(StandIn):
    """The stand-in as a registry one pushes to: it has every blob (``HEAD`` 200: nothing is
    uploaded) and takes every manifest (kept in ``put`` by path); the tag's own answer is the crafted one."""

    def __init__(self) -> None:
        super().__init__()
        self.put: dict[str, bytes] = {}

    def _answer(self, handler: BaseHTTPRequestHandler) -> None:
        path = handler.path.split("?")[0]
        if handler.command == "HEAD" and "/blobs/" in path:
            handler.send_response(200)
            handler.send_header("Content-Length", "0")
            handler.end_headers()
        elif handler.command == "PUT" and "/manifests/" in path:
            self.put[path] = handler.rfile.read(int(handler.headers.get("Content-Length") or 0))
            handler.send_response(201)
            handler.send_header("Content-Length", "0")
            handler.end_headers()
        else:
            super()._answer(handler)


@pytest.mark.parametrize("case", ["platform-a-string", "manifests-a-number", "nested-utf16"])
def test_a_push_to_a_tag_whose_index_is_hostile_is_a_refusal_naming_the_tag(
        case: str, oci_qcow2: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``vmsidecar-oci push`` merges its entry into the index already under the tag (the other
    architectures' entries are kept): that index is the registry's answer, read like a pull's."""
    from vmsidecar_runtime.oci.cli import main

    registry = _Accepting()
    with registry.registry:
        _serve(case, registry)
        status = main(["push", str(oci_qcow2), f"{registry.host}/hostile:t", "--plain-http"])
    error = capsys.readouterr().err
    assert status == 2, error
    assert "unexpected" not in error, error
    assert f"{registry.host}/hostile:t: the registry's answer is malformed" in error, error
    assert "delete the tag" in error, error
    assert "/v2/hostile/manifests/t" not in registry.put, "the tag is not overwritten"


@pytest.mark.parametrize("case", ["manifests-a-number", "nested-utf16", "a-json-string"])
def test_a_snapshot_push_whose_referrers_tag_is_hostile_is_a_refusal_naming_the_tag(case: str) -> None:
    """``vmsidecar-oci snapshot push`` on a registry without the referrers API (distribution 2.8)
    keeps the referrers tag schema's index of the image: the index already there is read first."""
    subject = _digest(b"the image's manifest")
    tag = referrers_tag(subject)
    crafted = {"manifests-a-number": json.dumps(_index(5)).encode(), "nested-utf16": NESTED_UTF16,
               "a-json-string": b'"x"'}[case]
    registry = _Accepting()
    with registry.registry, _client(registry.host) as client:
        registry.manifest("snaps", tag, crafted, OCI_INDEX)
        with pytest.raises(ImageError) as refused:
            _add_referrer(client, subject, _entry(_digest(b"the snapshot")))
    assert refused.value.code == "bad_answer", refused.value
    assert f"snaps:{tag}" in refused.value.message, refused.value.message
    assert not registry.put, "the referrers tag is not overwritten"


def test_a_snapshot_push_keeps_the_referrers_of_others_and_drops_junk_entries() -> None:
    subject = _digest(b"the image's manifest")
    tag = referrers_tag(subject)
    other = _entry(_digest(b"another snapshot"))
    registry = _Accepting()
    with registry.registry, _client(registry.host) as client:
        registry.manifest("snaps", tag, _index(["x", 5, other]), OCI_INDEX)
        _add_referrer(client, subject, _entry(_digest(b"the snapshot")))
    written = json.loads(registry.put[f"/v2/snaps/manifests/{tag}"])
    assert [d["digest"] for d in written["manifests"]] == [other["digest"], _digest(b"the snapshot")]



def test_a_snapshot_push_supersedes_the_listed_artifact_of_its_own_key() -> None:
    # each capture of one key pushed again would otherwise grow the index by one entry for good
    subject = _digest(b"the image's manifest")
    tag = referrers_tag(subject)
    snapshot = "application/vnd.vmsidecar.snapshot.v1"
    older = _entry(_digest(b"last week's capture"), artifactType=snapshot, annotations={KEY: "k1"})
    other_key = _entry(_digest(b"another QEMU's capture"), artifactType=snapshot, annotations={KEY: "k2"})
    not_ours = _entry(_digest(b"a signature"), artifactType="application/vnd.dev.cosign", annotations={KEY: "k1"})
    registry = _Accepting()
    with registry.registry, _client(registry.host) as client:
        registry.manifest("snaps", tag, _index([older, other_key, not_ours]), OCI_INDEX)
        _add_referrer(client, subject, _entry(_digest(b"today's capture"), artifactType=snapshot,
                                              annotations={KEY: "k1"}))
    written = json.loads(registry.put[f"/v2/snaps/manifests/{tag}"])
    assert [d["digest"] for d in written["manifests"]] == [other_key["digest"], not_ours["digest"],
                                                           _digest(b"today's capture")]


def test_a_snapshot_layer_whose_size_no_float_holds_is_refused_as_too_large(stand_in: StandIn,
                                                                          tmp_path: Path) -> None:
    # JSON integers have no bound; the refusal's message once divided it into a float (OverflowError:
    # not a refusal, so the boot was left in Starting with no QEMU, at every boot)
    subject = _digest(b"the image's manifest")
    base = DiskImage(tmp_path / "d.qcow2", "qcow2", "sha256:" + "0" * 64, f"{stand_in.host}/hostile:1",
                     manifest_digest=subject)
    identity = identify(VmSpec.model_validate({"image": f"{stand_in.host}/hostile:1"}), base, "tcg")
    layer = {"mediaType": SNAPSHOT_FILE, "digest": _digest(b"{}"), "size": 10 ** 400,
             "annotations": {"org.opencontainers.image.title": "memory"}}
    artifact = {**_image([layer]), "artifactType": SNAPSHOT_ARTIFACT_TYPE, "annotations": identity.annotations(),
                "subject": _entry(subject)}
    digest = stand_in.manifest("snaps", "artifact", artifact)
    stand_in.manifest("snaps", referrers_tag(subject),
                      _index([_entry(digest, artifactType=SNAPSHOT_ARTIFACT_TYPE)]), OCI_INDEX)
    with pytest.raises(SourceRefused) as refused:
        fetch_snapshot(f"{stand_in.host}/snaps", identity, base, SnapshotStore(tmp_path / "cache"),
                       deadline=time.monotonic() + 60)
    assert refused.value.code == "too_large", refused.value.message
    assert "memory" in refused.value.message, refused.value.message

@contextlib.contextmanager
def _client(host: str) -> Iterator[RegistryClient]:
    client = RegistryClient(parse_reference(f"{host}/snaps"), plain_http=True)
    try:
        yield client
    finally:
        client.close()
