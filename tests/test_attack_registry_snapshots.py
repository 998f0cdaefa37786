"""Attacks on snapshot artifacts in a registry (issue 23, item 2), without a guest.

Whoever can push to a repository, or alter the registry's storage, is the attacker: a runtime
whose spec names that repository as its ``snapshot_source`` must restore only a snapshot of its
own key, fetched by digest, whose every byte is the one its digests and its seal name, and
never one from another repository. Each refusal carries a code of the fixed set
(``SnapshotInfo.source_refusal``) and a message naming the cause.

The snapshot here is a real cache entry, sealed by the real ``SnapshotStore`` (RAM-like bytes, a
real qcow2 frozen overlay on the pulled image, scrollback); it is published by the real
``vmsidecar-oci snapshot push`` code to a real distribution 2.8 registry (no referrers API: the
tag schema) and fetched by the runtime's own fetch. tests/test_registry_snapshots.py boots guests
from real captures.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import zstandard

from fixtures.registry import Crafter, RunningRegistry, copy_manifest, start_registry
from vmsidecar_contract.spec import load_spec
from vmsidecar_runtime.accel import choose_accel
from vmsidecar_runtime.controller.source_fetch import SourceFetch
from vmsidecar_runtime.disk import DiskImage
from vmsidecar_runtime.oci import pull, push_artifact
from vmsidecar_runtime.oci.mediatypes import OCI_INDEX, OCI_MANIFEST, SNAPSHOT_FILE, SNAPSHOT_FILE_ZSTD
from vmsidecar_runtime.oci.reference import parse_reference
from vmsidecar_runtime.oci.registry import RegistryClient
from vmsidecar_runtime.oci.snapshot_artifact import referrers_tag
from vmsidecar_runtime.oci.snapshot_fetch import SourceRefused, complete, fetch_snapshot, stage_before_pull
from vmsidecar_runtime.oci.snapshot_push import push_snapshot
from vmsidecar_runtime.snapshot_identity import (
    IMAGE_FIELDS,
    PREFIX,
    SnapshotIdentity,
    host_cpu,
    identify,
    identify_before_pull,
)
from vmsidecar_runtime.snapshots import TEMPLATED, SnapshotMeta, SnapshotStore, seal_digest

pytestmark = pytest.mark.timeout(240)

TITLE = "org.opencontainers.image.title"


@dataclass
class Published:
    """An image and the snapshot artifact of its spec in one repository."""

    registry: RunningRegistry
    repo: str
    spec: dict
    identity: SnapshotIdentity
    subject: str
    artifact: str
    memory: bytes

    @property
    def source(self) -> str:
        return f"{self.registry.host}/{self.repo}"


def _base(image: str, cache: Path) -> DiskImage:
    pulled = pull(image, cache, arch="x86_64")
    return DiskImage(pulled.path, pulled.format, pulled.digest, image, pulled.annotations, pulled.manifest_digest)


def _publish(registry: RunningRegistry, repo: str, disk: Path, work: Path) -> Published:
    """Push ``disk`` to ``repo``, seal a snapshot entry of its spec in a cache, push the snapshot."""
    image = f"{registry.host}/{repo}:v1"
    push_artifact(disk, image)
    spec = {"image": image, "memory": "256M"}
    cache = work / "capture-cache"
    base = _base(image, cache)
    identity = identify(load_spec(spec), base, choose_accel("auto", "x86_64").accel)
    store = SnapshotStore(cache)
    staged = store.staging(identity.key)
    memory = os.urandom(96 << 10) + b"\0" * (256 << 10)  # the device state (a templated capture's stream)
    staged.memory.write_bytes(memory)
    with open(staged.ram, "wb") as ram:  # the guest's RAM: some noise, the rest never written (a hole)
        ram.write(os.urandom(256 << 10))
        ram.truncate(16 << 20)
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(base.path), "-F", base.format,
                    str(staged.disk)], check=True, timeout=30)
    store.commit(staged, identity.key, {"ttyS0": b"VMSIDECAR-READY image=fake\n"},
                 SnapshotMeta(guest_agent=False, form=TEMPLATED))
    pushed = push_snapshot(registry.host + "/" + repo, cache, load_spec(spec))
    assert pushed.tag_schema  # distribution 2.8 has no referrers API
    assert base.manifest_digest is not None
    return Published(registry, repo, spec, identity, base.manifest_digest, pushed.digest, memory)


@pytest.fixture(scope="module")
def published(registry: RunningRegistry, oci_qcow2: Path, tmp_path_factory: pytest.TempPathFactory) -> Published:
    return _publish(registry, "snapattack/good", oci_qcow2, tmp_path_factory.mktemp("snapattack"))


def _fetch(pub: Published, cache: Path, *, source: str | None = None, identity: SnapshotIdentity | None = None):
    base = _base(pub.spec["image"], cache)
    return fetch_snapshot(source or pub.source, identity or pub.identity, base, SnapshotStore(cache),
                          deadline=time.monotonic() + 60)


def _refused(pub: Published, cache: Path, **kw) -> SourceRefused:
    with pytest.raises(SourceRefused) as info:
        _fetch(pub, cache, **kw)
    assert not list((cache / "snapshots").glob(f"{pub.identity.key}")), "a refused snapshot reached the cache"
    assert not list((cache / "snapshots").glob(".incoming-*")), "the staged entry was left behind"
    return info.value


def _client(pub: Published, repo: str | None = None) -> RegistryClient:
    return RegistryClient(parse_reference(f"{pub.registry.host}/{repo or pub.repo}"))


def _republish(pub: Published, repo: str, edit: Callable[[dict, RegistryClient, Path], None]) -> str:
    """Copy the image and the artifact into ``repo`` with ``edit(manifest, client, tmp)`` applied to
    the artifact; list only that one in the subject's referrers tag schema index. Returns its digest."""
    src, dst = _client(pub), _client(pub, repo)
    try:
        copy_manifest(src, dst, pub.subject)
        doc = copy_manifest(src, dst, pub.artifact)
        with tempfile.TemporaryDirectory() as tmp:
            edit(doc, dst, Path(tmp))
        data = json.dumps(doc).encode()
        digest = dst.put_manifest(Crafter.digest(data), data, OCI_MANIFEST)
        entry = {"mediaType": OCI_MANIFEST, "digest": digest, "size": len(data), "artifactType": doc["artifactType"],
                 "annotations": dict(pub.identity.annotations())}  # the listing claims the right key
        index = json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [entry]}).encode()
        dst.put_manifest(referrers_tag(pub.subject), index, OCI_INDEX)
        return digest
    finally:
        src.close()
        dst.close()


def _refused_once_republished(pub: Published, repo: str, edit: Callable[[dict, RegistryClient, Path], None],
                              cache: Path) -> SourceRefused:
    """The refusal of the artifact :func:`_republish` puts in ``repo`` with ``edit`` applied."""
    _republish(pub, repo, edit)
    return _refused(pub, cache, source=f"{pub.registry.host}/{repo}")


def _layer(doc: dict, name: str) -> dict:
    return next(d for d in doc["layers"] if d["annotations"][TITLE] == name)


def test_the_published_snapshot_is_fetched_verified_and_rebased_onto_this_cache(published: Published,
                                                                                tmp_path: Path) -> None:
    # the control: everything right, so each refusal below is the check it names, not a broken fetch
    cache = tmp_path / "cache"
    snap = _fetch(published, cache)
    assert snap.path == cache / "snapshots" / published.identity.key
    assert snap.memory.read_bytes() == published.memory
    base = _base(published.spec["image"], cache)
    assert SnapshotStore(cache).verify(snap, base) is None  # the seal and the overlay's backing file hold
    doc = _client(published).get_manifest(published.artifact).json()
    assert doc["artifactType"] == "application/vnd.vmsidecar.snapshot.v1"
    assert doc["config"]["mediaType"] == "application/vnd.oci.empty.v1+json"
    assert doc["subject"]["digest"] == published.subject
    assert _layer(doc, "memory")["mediaType"] == SNAPSHOT_FILE_ZSTD
    assert _layer(doc, "meta.json")["mediaType"] == SNAPSHOT_FILE
    assert {k.removeprefix(PREFIX) for k in doc["annotations"]} == {
        "key", "image-digest", "qemu-version", "machine", "cpu", "accelerator", "readiness", "runtime-version", "format",
        "form"}
    assert doc["annotations"][PREFIX + "form"] == TEMPLATED


def test_an_artifact_of_another_key_is_refused_naming_the_field(published: Published, tmp_path: Path) -> None:
    def other_qemu(doc: dict, client: RegistryClient, tmp: Path) -> None:
        doc["annotations"][PREFIX + "qemu-version"] = "QEMU emulator version 99.0.0"

    refusal = _refused_once_republished(published, "snapattack/wrongkey", other_qemu, tmp_path / "cache")
    assert refusal.code == "key_mismatch"
    assert "QEMU version is 'QEMU emulator version 99.0.0'" in refusal.message, refusal.message


def test_a_runtime_of_another_cpu_model_refuses_the_artifact(published: Published, tmp_path: Path) -> None:
    refusal = _refused(published, tmp_path / "cache", identity=replace(published.identity, cpu="Skylake-Client"))
    assert refusal.code == "key_mismatch" and "CPU model" in refusal.message, refusal.message


def test_an_artifact_in_another_repository_is_never_read(published: Published, tmp_path: Path) -> None:
    # the image (and so the subject) is in both repositories; the artifact only in snapattack/good
    src, dst = _client(published), _client(published, "snapattack/elsewhere")
    try:
        copy_manifest(src, dst, published.subject)
    finally:
        src.close()
        dst.close()
    refusal = _refused(published, tmp_path / "cache", source=f"{published.registry.host}/snapattack/elsewhere")
    assert refusal.code == "not_found", refusal.message


@pytest.mark.parametrize("name", ["memory", "ttyS0.console"])  # zstd-compressed, and as it is
def test_a_layer_whose_bytes_are_not_its_digest_is_refused(oci_qcow2: Path, tmp_path: Path, name: str) -> None:
    # the registry's storage altered: distribution serves a blob's file as it is. A registry of its
    # own: blobs are shared by digest across repositories
    with start_registry(tmp_path / "registry") as reg:
        pub = _publish(reg, "snapattack/tampered", oci_qcow2, tmp_path / "work")
        doc = _client(pub).get_manifest(pub.artifact).json()
        blob = reg.blob_data(_layer(doc, name)["digest"])
        data = bytearray(blob.read_bytes())
        data[len(data) // 2] ^= 0x55
        blob.write_bytes(bytes(data))
        refusal = _refused(pub, tmp_path / "cache")
    assert refusal.code == "tampered" and "digest" in refusal.message, refusal.message


def test_a_layer_of_the_right_digest_that_does_not_decompress_is_refused(published: Published,
                                                                         tmp_path: Path) -> None:
    def garbled(doc: dict, client: RegistryClient, tmp: Path) -> None:
        layer = _layer(doc, "memory")
        good = zstandard.ZstdCompressor(write_checksum=True).compress(published.memory)  # as the push writes it
        bad = good[:32] + bytes(b ^ 0xFF for b in good[32:64]) + good[64:]  # a real frame, garbled after its header
        client.push_blob_bytes(bad, SNAPSHOT_FILE_ZSTD, tmp)
        layer.update(digest=Crafter.digest(bad), size=len(bad))

    refusal = _refused_once_republished(published, "snapattack/garbled", garbled, tmp_path / "cache")
    assert refusal.code == "bad_artifact" and "decompress" in refusal.message, refusal.message


def test_a_layer_of_the_right_digest_that_is_not_the_sealed_file_is_refused(published: Published,
                                                                            tmp_path: Path) -> None:
    def swapped(doc: dict, client: RegistryClient, tmp: Path) -> None:
        layer = _layer(doc, "memory")
        other = os.urandom(len(published.memory))  # another guest's RAM, honestly digested
        client.push_blob_bytes(other, SNAPSHOT_FILE, tmp)
        layer.update(mediaType=SNAPSHOT_FILE, digest=Crafter.digest(other), size=len(other))

    refusal = _refused_once_republished(published, "snapattack/swapped", swapped, tmp_path / "cache")
    assert refusal.code == "tampered" and "meta.json" in refusal.message, refusal.message


def test_a_layer_titled_as_a_path_is_refused(published: Published, tmp_path: Path) -> None:
    def escaping(doc: dict, client: RegistryClient, tmp: Path) -> None:
        _layer(doc, "memory")["annotations"][TITLE] = "../../memory"

    refusal = _refused_once_republished(published, "snapattack/escape", escaping, tmp_path / "cache")
    assert refusal.code == "bad_artifact" and "plain file name" in refusal.message, refusal.message
    assert not (tmp_path / "memory").exists()


def test_an_index_claiming_the_right_key_for_a_manifest_of_another_is_refused(published: Published,
                                                                             tmp_path: Path) -> None:
    # _republish lists the artifact with this runtime's annotations: the manifest's own decide
    def other_cpu(doc: dict, client: RegistryClient, tmp: Path) -> None:
        doc["annotations"][PREFIX + "cpu"] = "host"

    refusal = _refused_once_republished(published, "snapattack/lying-index", other_cpu, tmp_path / "cache")
    assert refusal.code == "key_mismatch" and "CPU model" in refusal.message, refusal.message


def test_a_frozen_overlay_that_grows_the_guests_disk_past_the_limit_is_refused(published: Published,
                                                                               tmp_path: Path) -> None:
    # a consistently sealed artifact whose overlay claims 2 PiB: the guest could fill the host through it
    def huge_overlay(doc: dict, client: RegistryClient, tmp: Path) -> None:
        overlay = tmp / "disk.qcow2"
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-u", "-b", "/capture/base.qcow2", "-F", "qcow2",
                        str(overlay), "2P"], check=True, timeout=30)
        data = overlay.read_bytes()
        meta_layer = _layer(doc, "meta.json")
        with client.open_blob(meta_layer) as chunks:
            meta = json.loads(b"".join(chunks))
        meta["files"]["disk.qcow2"] = Crafter.digest(data)
        meta_bytes = json.dumps(meta).encode()
        for name, blob in (("disk.qcow2", data), ("meta.json", meta_bytes)):
            client.push_blob_bytes(blob, SNAPSHOT_FILE, tmp)
            _layer(doc, name).update(mediaType=SNAPSHOT_FILE, digest=Crafter.digest(blob), size=len(blob))

    refusal = _refused_once_republished(published, "snapattack/huge", huge_overlay, tmp_path / "cache")
    assert refusal.code == "too_large" and "2 PiB" in refusal.message, refusal.message


def test_a_meta_json_built_to_exhaust_the_parser_is_refused(published: Published, tmp_path: Path) -> None:
    def deep_meta(doc: dict, client: RegistryClient, tmp: Path) -> None:
        deep = b"[" * 20000 + b"]" * 20000  # Python's parser recurses: a RecursionError, not a refusal
        client.push_blob_bytes(deep, SNAPSHOT_FILE, tmp)
        _layer(doc, "meta.json").update(digest=Crafter.digest(deep), size=len(deep))

    refusal = _refused_once_republished(published, "snapattack/deep-meta", deep_meta, tmp_path / "cache")
    assert refusal.code == "bad_artifact" and "meta.json" in refusal.message, refusal.message


def test_an_artifact_sealed_without_the_memory_stream_is_refused(published: Published, tmp_path: Path) -> None:
    def no_memory(doc: dict, client: RegistryClient, tmp: Path) -> None:
        doc["layers"] = [d for d in doc["layers"] if d["annotations"][TITLE] != "memory"]
        with client.open_blob(_layer(doc, "meta.json")) as chunks:
            meta = json.loads(b"".join(chunks))
        del meta["files"]["memory"]
        data = json.dumps(meta).encode()
        client.push_blob_bytes(data, SNAPSHOT_FILE, tmp)
        _layer(doc, "meta.json").update(digest=Crafter.digest(data), size=len(data))

    refusal = _refused_once_republished(published, "snapattack/no-memory", no_memory, tmp_path / "cache")
    assert refusal.code == "bad_artifact" and "lacks files every snapshot has" in refusal.message, refusal.message


def _meta(doc: dict, client: RegistryClient) -> dict:
    with client.open_blob(_layer(doc, "meta.json")) as chunks:
        return json.loads(b"".join(chunks))


def _put_file(doc: dict, client: RegistryClient, tmp: Path, name: str, data: bytes, meta: dict) -> None:
    """The file ``name`` of the artifact replaced by ``data`` (zstd-compressed as the push does, or
    added), and sealed in ``meta`` as the capture would have: the seal holds, only its size is hostile."""
    (tmp / name).write_bytes(data)
    meta["files"][name] = seal_digest(tmp / name)
    blob = zstandard.ZstdCompressor(write_checksum=True).compress(data)
    client.push_blob_bytes(blob, SNAPSHOT_FILE_ZSTD, tmp)
    layer = {"mediaType": SNAPSHOT_FILE_ZSTD, "digest": Crafter.digest(blob), "size": len(blob),
             "annotations": {TITLE: name}}
    doc["layers"] = [d for d in doc["layers"] if d["annotations"][TITLE] != name] + [layer]


def _put_meta(doc: dict, client: RegistryClient, tmp: Path, meta: dict) -> None:
    data = json.dumps(meta).encode()
    client.push_blob_bytes(data, SNAPSHOT_FILE, tmp)
    _layer(doc, "meta.json").update(mediaType=SNAPSHOT_FILE, digest=Crafter.digest(data), size=len(data))


def test_a_sealed_console_larger_than_any_scrollback_is_refused(published: Published, tmp_path: Path) -> None:
    # 64 MiB of scrollback in 2 KiB of zstd, sealed: each restore read it whole into the runtime's memory
    # (a console keeps 256 KiB), and the cache kept it for every restore after
    def huge_console(doc: dict, client: RegistryClient, tmp: Path) -> None:
        meta = _meta(doc, client)
        _put_file(doc, client, tmp, "ttyS0.console", bytes(64 << 20), meta)
        _put_meta(doc, client, tmp, meta)

    refusal = _refused_once_republished(published, "snapattack/huge-console", huge_console, tmp_path / "cache")
    assert refusal.code == "bad_artifact" and "ttyS0.console" in refusal.message, refusal.message
    assert "256 KiB" in refusal.message, refusal.message


def test_a_meta_json_that_decompresses_past_its_bound_is_refused(published: Published, tmp_path: Path) -> None:
    # a true meta.json followed by 256 MiB of blanks, in 8 KiB of zstd: still valid JSON, read whole
    # into memory (twice) on the way
    def bomb(doc: dict, client: RegistryClient, tmp: Path) -> None:
        data = json.dumps(_meta(doc, client)).encode() + b" " * (256 << 20)
        blob = zstandard.ZstdCompressor().compress(data)
        client.push_blob_bytes(blob, SNAPSHOT_FILE_ZSTD, tmp)
        _layer(doc, "meta.json").update(mediaType=SNAPSHOT_FILE_ZSTD, digest=Crafter.digest(blob), size=len(blob))

    refusal = _refused_once_republished(published, "snapattack/meta-bomb", bomb, tmp_path / "cache")
    assert refusal.code == "bad_artifact" and "meta.json" in refusal.message, refusal.message


def test_a_meta_json_of_the_other_form_than_its_key_is_refused(published: Published, tmp_path: Path) -> None:
    # the restore goes by meta.json's form: "stream" for a templated key restored the device state
    # without mapping the RAM file (a guest on zeroed RAM); the mirror, "templated" and a sealed RAM
    # file for a full-stream key (a spec with vhost-user GPIO has only that form), made such a spec's
    # QEMU argv fail an assertion: the boot left in Starting, at every boot
    def stream(doc: dict, client: RegistryClient, tmp: Path) -> None:
        meta = _meta(doc, client)
        meta["form"] = "stream"
        _put_meta(doc, client, tmp, meta)

    refusal = _refused_once_republished(published, "snapattack/other-form", stream, tmp_path / "cache")
    assert refusal.code == "bad_artifact" and "form" in refusal.message, refusal.message


def test_a_layer_title_no_file_system_takes_is_refused_as_the_artifacts_fault(published: Published,
                                                                              tmp_path: Path) -> None:
    def long_title(doc: dict, client: RegistryClient, tmp: Path) -> None:
        _layer(doc, "ttyS0.console")["annotations"][TITLE] = "c" * 300 + ".console"

    refusal = _refused_once_republished(published, "snapattack/long-title", long_title, tmp_path / "cache")
    assert refusal.code == "bad_artifact" and "plain file name" in refusal.message, refusal.message


def _listing(pub: Published, repo: str, others: int, *, deleted: bool = False) -> None:
    """The image and the artifact in ``repo``, listed in the subject's tag schema index after
    ``others`` artifacts of other keys (each a real manifest there: distribution checks an index's
    entries), or after one claiming the same key that is then ``deleted``."""
    src, dst = _client(pub), _client(pub, repo)
    try:
        copy_manifest(src, dst, pub.subject)
        doc = copy_manifest(src, dst, pub.artifact)
        entries = []
        for i in range(others):
            variant = {**doc, "annotations": {**doc["annotations"], PREFIX + "key": "another-key" if not deleted
                                              else doc["annotations"][PREFIX + "key"], PREFIX + "n": str(i)}}
            data = json.dumps(variant).encode()
            digest = dst.put_manifest(Crafter.digest(data), data, OCI_MANIFEST)
            entries.append(_listed(variant, digest, len(data)))
        entries.append(_listed(doc, pub.artifact, len(json.dumps(doc))))
        index = json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries}).encode()
        dst.put_manifest(referrers_tag(pub.subject), index, OCI_INDEX)
        if deleted:
            for entry in entries[:-1]:
                gone = urllib.request.Request(f"{pub.registry.url}/v2/{repo}/manifests/{entry['digest']}",
                                              method="DELETE")
                with urllib.request.urlopen(gone, timeout=10) as answer:
                    assert answer.status == 202
    finally:
        src.close()
        dst.close()


def _listed(doc: dict, digest: str, size: int) -> dict:
    return {"mediaType": OCI_MANIFEST, "digest": digest, "size": size, "artifactType": doc["artifactType"],
            "annotations": doc["annotations"]}


def test_a_listed_artifact_the_registry_no_longer_has_does_not_hide_the_next(published: Published,
                                                                            tmp_path: Path) -> None:
    # the tag schema's index is only ever appended to: an artifact deleted since is still listed,
    # claiming the key, ahead of the one the registry has
    _listing(published, "snapattack/stale-entry", 1, deleted=True)
    snap = _fetch(published, tmp_path / "cache", source=f"{published.registry.host}/snapattack/stale-entry")
    assert snap.memory.read_bytes() == published.memory


def test_the_snapshot_listed_after_many_of_other_keys_is_found(published: Published, tmp_path: Path) -> None:
    # 70 snapshots of other keys (other QEMUs, CPU models, runtime versions) pushed before this one
    _listing(published, "snapattack/crowded", 70)
    snap = _fetch(published, tmp_path / "cache", source=f"{published.registry.host}/snapattack/crowded")
    assert snap.memory.read_bytes() == published.memory


# ---- the fetch started while the image is pulled (controller/source_fetch.py) -------------------
# Before the disk is there, an artifact can be checked in every field but the image digest, the
# readiness and the key (IMAGE_FIELDS); what it staged must then pass the whole key, the subject
# and the rebase, or go.


def _known(pub: Published) -> SnapshotIdentity:
    return identify_before_pull(load_spec(pub.spec), choose_accel("auto", "x86_64").accel)


def test_a_snapshot_fetched_before_the_disk_is_committed_only_under_the_whole_key(published: Published,
                                                                                  tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    store = SnapshotStore(cache)
    known = _known(published)
    assert {f for f in ("key", "image_digest", "readiness") if getattr(known, f)} == set()
    staged = stage_before_pull(published.source, published.subject, known, store, deadline=time.monotonic() + 60)
    assert not (cache / "snapshots" / published.identity.key).exists(), "staged, not committed"
    base = _base(published.spec["image"], cache)
    # another key (a spec of other memory, say): refused, and what was staged is gone
    with pytest.raises(SourceRefused) as info:
        complete(staged, replace(published.identity, key="0" * 32), base, store)
    assert info.value.code == "key_mismatch" and "spec (devices, memory" in info.value.message, info.value.message
    assert not list((cache / "snapshots").glob(".incoming-*")), "the staged entry was left behind"
    # the same artifact staged again, completed over another image's manifest: refused
    staged = stage_before_pull(published.source, published.subject, known, store, deadline=time.monotonic() + 60)
    with pytest.raises(SourceRefused) as info:
        complete(staged, published.identity, replace(base, manifest_digest="sha256:" + "1" * 64), store)
    assert info.value.code == "bad_artifact" and "subject" in info.value.message, info.value.message
    assert not list((cache / "snapshots").glob(".incoming-*"))
    # and under its own key, over its own image: the same entry the fetch after the pull makes
    staged = stage_before_pull(published.source, published.subject, known, store, deadline=time.monotonic() + 60)
    snap = complete(staged, published.identity, base, store)
    assert snap.path == cache / "snapshots" / published.identity.key
    assert snap.memory.read_bytes() == published.memory
    assert store.verify(snap, base) is None
    # a field known before the pull that differs (another QEMU) is refused before any layer is read
    with pytest.raises(SourceRefused) as info:
        stage_before_pull(published.source, published.subject, replace(known, qemu_version="QEMU 99"), store,
                          deadline=time.monotonic() + 60)
    assert info.value.code == "key_mismatch" and "QEMU version" in info.value.message


async def test_when_the_early_fetch_took_another_keys_artifact_the_source_is_asked_again(published: Published,
                                                                                        tmp_path: Path) -> None:
    # Two artifacts for the image, listed with the same annotations: one of another spec (its key
    # only differs), first; then this spec's. The early fetch cannot tell them apart and stages the
    # first; the whole key refuses it, and the source is asked again with the whole key.
    repo = "snapattack/two-specs"

    def other_spec(doc: dict, client: RegistryClient, tmp: Path) -> None:
        doc["annotations"][PREFIX + "key"] = "0" * 32

    other = _republish(published, repo, other_spec)
    src, dst = _client(published), _client(published, repo)
    try:
        good = copy_manifest(src, dst, published.artifact)
        listing = dst.get_manifest(referrers_tag(published.subject)).json()
        data = json.dumps(good).encode()
        listing["manifests"].append({"mediaType": OCI_MANIFEST, "digest": published.artifact, "size": len(data),
                                     "artifactType": good["artifactType"],
                                     "annotations": dict(published.identity.annotations())})
        dst.put_manifest(referrers_tag(published.subject), json.dumps(listing).encode(), OCI_INDEX)
    finally:
        src.close()
        dst.close()
    cache = tmp_path / "cache"
    store = SnapshotStore(cache)
    spec = load_spec({**published.spec, "snapshot_source": f"{published.registry.host}/{repo}"})
    fetch = SourceFetch(store, lambda backend: True)
    fetch.start(spec, published.subject)
    base = _base(published.spec["image"], cache)  # the pull, meanwhile
    snap = await fetch.snapshot(f"{published.registry.host}/{repo}", published.identity, base)
    assert snap.path == cache / "snapshots" / published.identity.key
    assert snap.memory.read_bytes() == published.memory
    assert other != published.artifact
    assert not list((cache / "snapshots").glob(".incoming-*")), "the other key's staging was left behind"


async def test_an_early_fetch_no_boot_uses_is_removed(published: Published, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    spec = load_spec({**published.spec, "snapshot_source": published.source})
    fetch = SourceFetch(SnapshotStore(cache), lambda backend: True)
    fetch.start(spec, published.subject)
    assert fetch._fetch is not None
    task = fetch._fetch[2]
    fetch.drop()  # e.g. the pull failed, or the cache had the snapshot after all
    await asyncio.wait([task], timeout=60)
    await asyncio.sleep(0)  # the done callbacks run on the loop
    staged = task.result().snap.path
    assert staged.name.startswith(".incoming-") and not staged.exists(), "what the fetch staged stayed"
    assert not list((cache / "snapshots").iterdir()), list((cache / "snapshots").iterdir())


#: /proc/cpuinfo of a node with another CPU than this machine's (two processors, as the kernel prints them)
OTHER_NODE_CPUINFO = "".join(
    f"processor\t: {n}\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 85\n"
    f"model name\t: Intel(R) Xeon(R)\nstepping\t: 7\nmicrocode\t: 0x5003604\n"
    f"flags\t\t: fpu vme de pse tsc msr pae sse sse2 avx avx2 avx512f\n\n"
    for n in range(2))


@pytest.mark.parametrize("model", [None, "host", "max"])
def test_a_snapshot_of_the_host_cpu_passed_through_never_restores_on_a_node_of_another_cpu(
    published: Published, monkeypatch: pytest.MonkeyPatch, model: str | None
) -> None:
    """Under KVM, ``host`` (the default) and ``max`` hand the guest the node's own CPU: its state,
    restored on a node of another CPU, runs instructions that CPU lacks. The identity names the CPU
    behind them, so a node of another kind refuses the other's artifact (and its own cache entry,
    were the cache moved): another node is simulated by its /proc/cpuinfo, which this machine cannot
    change. TCG's models and a named model are the same on every node, as before."""
    spec = load_spec({**published.spec, "cpu": model})
    here = identify_before_pull(spec, "kvm")
    with monkeypatch.context() as other_node:
        other_node.setattr("vmsidecar_runtime.snapshot_identity.read_cpuinfo", lambda: OTHER_NODE_CPUINFO,
                           raising=False)
        there = identify_before_pull(spec, "kvm")
        named = identify_before_pull(load_spec({**published.spec, "cpu": "EPYC-v3"}), "kvm")
        tcg = identify_before_pull(load_spec(published.spec), "tcg")
    why = here.mismatch(there.annotations(), ignore=IMAGE_FIELDS)
    assert why is not None and why.startswith("its CPU model is "), why
    assert repr(here.cpu) in why and repr(there.cpu) in why, why  # both CPUs named
    assert there.cpu == f"{model or 'host'} (GenuineIntel 6 85 7, features {there.cpu[-13:-1]})", there
    vendors = {line.partition(":")[2].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
               if line.startswith("vendor_id")}
    assert all(vendor in here.cpu for vendor in vendors), (vendors, here)
    assert here.cpu.startswith(f"{model or 'host'} (") and there.cpu.startswith(f"{model or 'host'} ("), there
    assert named == identify_before_pull(load_spec({**published.spec, "cpu": "EPYC-v3"}), "kvm")
    assert named.cpu == "EPYC-v3"
    assert tcg == identify_before_pull(load_spec(published.spec), "tcg") and tcg.cpu == "max"


def test_the_host_cpu_of_an_arm_node_with_two_kinds_of_core_is_both_kinds() -> None:
    core = ("processor\t: {n}\nBogoMIPS\t: 50.00\n"
            "Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 {extra}\n"
            "CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x{variant}\nCPU part\t: 0x{part}\n"
            "CPU revision\t: 0\n\n")
    little = {"variant": 2, "part": "d05", "extra": ""}
    big = {"variant": 1, "part": "d0b", "extra": "atomics"}
    both = host_cpu("".join(core.format(n=n, **(little if n < 4 else big)) for n in range(8)))
    kinds = both.split(" + ")
    assert [k.split(",")[0] for k in kinds] == ["0x41 8 0x1 0xd0b 0", "0x41 8 0x2 0xd05 0"], both
    assert kinds[0].split("features ")[1] != kinds[1].split("features ")[1], "the features differ"
    assert host_cpu("") == "unknown"


async def test_a_source_that_trickles_its_answer_is_given_up_at_the_fetchs_bound(tmp_path: Path) -> None:
    """The fetch's bound was checked between a blob's chunks only: a source answering its referrers
    listing one byte every 0.2 s (a 100 KB body: five and a half hours) held the boot, and the power
    lock with it, for as long as it went on. The boot now gives up at the bound (then boots cold),
    whatever the fetching thread is blocked in (here the listing trickles a byte a second)."""
    from fixtures.trickle import Trickle
    from vmsidecar_runtime.oci import auth
    from vmsidecar_runtime.oci.snapshot_fetch import stage_in_thread

    store = SnapshotStore(tmp_path / "cache")
    known = identify_before_pull(load_spec({"image": "registry.example/vm/guest:1", "memory": "256M"}), "tcg")
    started = time.monotonic()
    with Trickle() as server, auth.settings(insecure=(server.host,)), \
            pytest.raises(SourceRefused) as refused:
        await stage_in_thread(f"{server.host}/snapshots", "sha256:" + "a" * 64, known, store, timeout=1.0)
    took = time.monotonic() - started
    assert refused.value.code == "timeout", refused.value.message
    assert took < 10, f"the fetch took {took:.1f} s for a bound of 1 s"
