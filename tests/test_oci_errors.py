"""Bad input: every case is refused with one sentence naming the cause and the fix, and leaves
nothing usable in the cache."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import socket
import tarfile
import time
from pathlib import Path

import pytest
import zstandard

from fixtures.registry import Crafter, RunningRegistry, make_qcow2
from vmsidecar_contract.errors import (
    BadReferenceError,
    DigestMismatchError,
    ImageError,
    PlatformError,
    RegistryError,
)
from vmsidecar_runtime.oci import pull, push_artifact, write_layout

TITLE = "org.opencontainers.image.title"


def assert_nothing_left(cache: Path) -> None:
    for sub in ("disks", "tmp"):
        d = cache / sub
        assert not d.exists() or list(d.iterdir()) == [], f"{sub}: {list(d.iterdir())}"


def assert_sentence(message: str) -> None:
    assert "; " in message, "cause; fix"
    assert "\n" not in message and "Traceback" not in message


def expect(
    exc_type: type[Exception], ref: str, cache: Path, *needles: str, code: str | None = None, **kw: object
):
    with pytest.raises(exc_type) as info:
        pull(ref, cache, **kw)  # type: ignore[arg-type]
    message = info.value.message  # type: ignore[attr-defined]
    for needle in needles:
        assert needle in message, message
    if code:
        assert info.value.code == code  # type: ignore[attr-defined]
    assert_sentence(message)
    assert_nothing_left(cache)
    return info.value


def test_unknown_scheme(tmp_path: Path) -> None:
    expect(BadReferenceError, "ftp://x", tmp_path / "c", "unknown scheme 'ftp'", "oci-layout:DIR[:TAG]")


def test_missing_registry_host(tmp_path: Path) -> None:
    expect(BadReferenceError, "foo/bar:1", tmp_path / "c", "no registry host", "127.0.0.1:5000/foo/bar:1")


def test_registry_unreachable_is_bounded_and_names_host(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    expect(
        RegistryError,
        f"127.0.0.1:{port}/vm/tiny:1",
        tmp_path / "c",
        f"registry 127.0.0.1:{port} is unreachable after 3 tries",
        "check that it runs",
        code="registry_unreachable",
    )
    assert time.monotonic() - start < 10


def test_tag_not_found_lists_tags(registry: RunningRegistry, oci_qcow2: Path, tmp_path: Path) -> None:
    push_artifact(oci_qcow2, f"{registry.host}/err/tags:real")
    expect(
        RegistryError,
        f"{registry.host}/err/tags:missing",
        tmp_path / "c",
        "tag missing not found in",
        "(tags there: real)",
        "push it first",
        code="tag_not_found",
    )


def test_repository_not_found(registry: RunningRegistry, tmp_path: Path) -> None:
    expect(
        RegistryError,
        f"{registry.host}/err/nowhere:1",
        tmp_path / "c",
        f"repository err/nowhere not found on {registry.host}",
        code="repository_not_found",
    )


def test_manifest_without_disk_layer(registry: RunningRegistry, tmp_path: Path) -> None:
    c = Crafter(registry=registry, repo="err/nodisk")
    sbom = c.blob(b'{"spdx": true}', "application/spdx+json")
    ref = c.tag(c.manifest([sbom]), "1")
    expect(ImageError, ref, tmp_path / "c", "has no disk layer (application/spdx+json)", code="no_disk")


def test_manifest_with_two_disk_layers(registry: RunningRegistry, tmp_path: Path) -> None:
    c = Crafter(registry=registry, repo="err/twodisks")
    a = c.blob(b"QFI\xfb" + b"\0" * 100, "application/vnd.diskimage.qcow2", {TITLE: "a.qcow2"})
    b = c.blob(os.urandom(512), "application/vnd.diskimage.raw", {TITLE: "b.raw"})
    ref = c.tag(c.manifest([a, b], artifact_type="application/vnd.diskimage.qcow2"), "1")
    expect(ImageError, ref, tmp_path / "c", "has 2 disk layers (a.qcow2, b.raw)", code="several_disks")


def test_tampered_blob_in_registry_storage(registry: RunningRegistry, tmp_path: Path) -> None:
    disk = make_qcow2(tmp_path / "tamper.qcow2", pattern=0x77)
    ref = f"{registry.host}/err/tampered:1"
    push_artifact(disk, ref, compression=None)
    # the layer is the disk itself: flip one byte of the registry's stored copy
    stored = registry.blob_data("sha256:" + hashlib.sha256(disk.read_bytes()).hexdigest())
    data = bytearray(stored.read_bytes())
    data[-1] ^= 0xFF
    stored.write_bytes(bytes(data))
    expect(
        DigestMismatchError,
        ref,
        tmp_path / "c",
        "has digest sha256:",
        "but its descriptor names",
        "push the image again",
    )


def _layout_with_layer(tmp_path: Path, disk: Path) -> tuple[Path, dict]:
    layout = tmp_path / "layout"
    digest = write_layout(disk, layout, tag="v1")
    manifest = json.loads((layout / "blobs/sha256" / digest[7:]).read_bytes())
    return layout, manifest["layers"][0]


def test_tampered_blob_in_layout(oci_qcow2: Path, tmp_path: Path) -> None:
    layout, layer = _layout_with_layer(tmp_path, oci_qcow2)
    blob = layout / "blobs/sha256" / layer["digest"][7:]
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x01
    blob.write_bytes(bytes(data))
    expect(DigestMismatchError, f"oci-layout:{layout}:v1", tmp_path / "c", "but its descriptor names")


def test_wrong_size_in_layout_descriptor(oci_qcow2: Path, tmp_path: Path) -> None:
    c = Crafter(layout=tmp_path / "layout")
    data = zstandard.ZstdCompressor().compress(oci_qcow2.read_bytes())
    layer = c.blob(data, "application/vnd.diskimage.qcow2+zstd", {TITLE: "x.qcow2.zst"})
    layer["size"] = len(data) - 10
    ref = c.tag(c.manifest([layer]), "v")
    expect(DigestMismatchError, ref, tmp_path / "c", f"more than the {len(data) - 10} bytes")


def test_disk_digest_annotation_mismatch(oci_qcow2: Path, tmp_path: Path) -> None:
    c = Crafter(layout=tmp_path / "layout")
    layer = c.blob(
        oci_qcow2.read_bytes(),
        "application/vnd.diskimage.qcow2",
        {TITLE: "x.qcow2", "io.vmsidecar.disk.digest": "sha256:" + "0" * 64},
    )
    ref = c.tag(c.manifest([layer]), "v")
    expect(DigestMismatchError, ref, tmp_path / "c", "io.vmsidecar.disk.digest names sha256:000")


@pytest.mark.parametrize(
    ("media_type", "needle"),
    [
        ("application/vnd.diskimage.qcow2+bzip2", "compressed with bzip2"),
        ("application/vnd.diskimage.raw+lz4", "compressed with lz4"),
        ("application/vnd.oci.image.layer.v1.tar+lz4", "compressed with lz4"),
    ],
)
def test_unsupported_compression(tmp_path: Path, media_type: str, needle: str) -> None:
    c = Crafter(layout=tmp_path / "layout")
    layer = c.blob(b"BZh91AY&SY", media_type, {TITLE: "x.qcow2"})
    ref = c.tag(c.manifest([layer]), "v")
    expect(ImageError, ref, tmp_path / "c", needle, "zstd or gzip", code="unsupported_compression")


def test_unsupported_disk_format(tmp_path: Path) -> None:
    c = Crafter(layout=tmp_path / "layout")
    layer = c.blob(b"vmdk", "application/vnd.diskimage.vmdk", {TITLE: "x.vmdk"})
    ref = c.tag(c.manifest([layer]), "v")
    expect(ImageError, ref, tmp_path / "c", "vmdk disk layer", "qemu-img convert", code="unsupported_format")


def test_wrong_architecture_lists_available_platforms(
    registry: RunningRegistry, oci_qcow2: Path, tmp_path: Path
) -> None:
    ref = f"{registry.host}/err/amd64only:1"
    push_artifact(oci_qcow2, ref, arch="x86_64")
    expect(
        PlatformError,
        ref,
        tmp_path / "c",
        "has no image for linux/arm64 (available: linux/amd64)",
        "--arch",
        arch="aarch64",
    )


def test_single_arch_containerdisk_for_other_arch(tmp_path: Path) -> None:
    c = Crafter(layout=tmp_path / "layout")
    tar_data = _tar({"disk/x.img": b"\0" * 4096})
    manifest = c.manifest(
        [c.blob(tar_data, "application/vnd.oci.image.layer.v1.tar")],
        config=c.image_config("arm64", ["sha256:" + hashlib.sha256(tar_data).hexdigest()]),
    )
    expect(PlatformError, c.tag(manifest, "v"), tmp_path / "c", "single-arch image for arm64", arch="x86_64")


def _tar(members: dict[str, bytes], links: dict[str, str] | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE
            info.linkname = target
            tar.addfile(info)
    return buf.getvalue()


def test_containerdisk_without_disk_file(tmp_path: Path) -> None:
    c = Crafter(layout=tmp_path / "layout")
    tar_data = _tar({"etc/hostname": b"x\n", "disk/notes.txt": b"no disk here"})
    layer = c.blob(gzip.compress(tar_data), "application/vnd.oci.image.layer.v1.tar+gzip")
    ref = c.tag(c.manifest([layer], config=c.image_config("amd64", [])), "v")
    expect(
        ImageError,
        ref,
        tmp_path / "c",
        "no .qcow2, .raw or .img file under /disk",
        code="no_disk",
        arch="x86_64",
    )


def test_containerdisk_with_two_disk_files(tmp_path: Path) -> None:
    c = Crafter(layout=tmp_path / "layout")
    tar_data = _tar({"disk/a.img": b"\0" * 512, "disk/b.img": b"\1" * 512})
    ref = c.tag(c.manifest([c.blob(tar_data, "application/vnd.oci.image.layer.v1.tar")]), "v")
    expect(
        ImageError, ref, tmp_path / "c", "several disk files under /disk (a.img, b.img)", code="several_disks"
    )


def test_containerdisk_disk_as_symlink(tmp_path: Path) -> None:
    c = Crafter(layout=tmp_path / "layout")
    tar_data = _tar({}, links={"disk/root.qcow2": "/etc/shadow"})
    ref = c.tag(c.manifest([c.blob(tar_data, "application/vnd.oci.image.layer.v1.tar")]), "v")
    expect(ImageError, ref, tmp_path / "c", "link or special file", code="unsafe_disk")


@pytest.mark.parametrize("size", [None, -1, "1024", 1.5, True])
def test_a_layer_without_a_whole_size_is_refused_before_its_blob_is_read(
        oci_qcow2: Path, tmp_path: Path, size: object) -> None:
    """OCI descriptors carry a size, and the blob reader holds the blob to it: without one, a stream
    that decompresses to nothing (zstd skippable frames) was downloaded for as long as it went on."""
    c = Crafter(layout=tmp_path / "layout")
    data = zstandard.ZstdCompressor().compress(oci_qcow2.read_bytes())
    layer = c.blob(data, "application/vnd.diskimage.qcow2+zstd", {TITLE: "x.qcow2.zst"})
    if size is None:
        del layer["size"]
    else:
        layer["size"] = size
    ref = c.tag(c.manifest([layer]), "v")
    expect(ImageError, ref, tmp_path / "c", layer["digest"], "size", code="bad_manifest")


@pytest.mark.parametrize("algorithm", ["sha512", "SHA256", "sha256-upper"])
def test_a_layer_digest_vmsidecar_cannot_verify_is_named_as_such(
        oci_qcow2: Path, tmp_path: Path, algorithm: str) -> None:
    """A sha512 (or upper-case) layer digest was fetched and then reported as a digest mismatch, as if
    the blob had been altered: the algorithm is what vmsidecar does not verify, and it says so."""
    c = Crafter(layout=tmp_path / "layout")
    layer = c.blob(zstandard.ZstdCompressor().compress(oci_qcow2.read_bytes()),
                   "application/vnd.diskimage.qcow2+zstd", {TITLE: "x.qcow2.zst"})
    hexdigest = layer["digest"][7:]
    layer["digest"] = {"sha512": "sha512:" + hexdigest * 2, "SHA256": "SHA256:" + hexdigest,
                       "sha256-upper": "sha256:" + hexdigest.upper()}[algorithm]
    ref = c.tag(c.manifest([layer]), "v")
    expect(ImageError, ref, tmp_path / "c", "not a sha256 digest", "push the image again", code="bad_manifest")


@pytest.mark.parametrize("title", ["../x.qcow2", "/etc/x.qcow2", "..", "sub/x.qcow2", "x\n.qcow2", "x\x1b[2J.qcow2"])
def test_layer_title_escaping_the_cache(tmp_path: Path, title: str) -> None:
    c = Crafter(layout=tmp_path / "layout")
    layer = c.blob(b"QFI\xfb" + b"\0" * 100, "application/vnd.diskimage.qcow2", {TITLE: title})
    ref = c.tag(c.manifest([layer]), "v")
    expect(ImageError, ref, tmp_path / "c", f"titled {title!r}", "not a plain file name", code="unsafe_path")
    assert not (tmp_path / "x.qcow2").exists()


def test_tar_member_escaping_disk_dir(tmp_path: Path) -> None:
    c = Crafter(layout=tmp_path / "layout")
    tar_data = _tar({"disk/../../x.qcow2": b"QFI\xfb" + b"\0" * 100})
    ref = c.tag(c.manifest([c.blob(tar_data, "application/vnd.oci.image.layer.v1.tar")]), "v")
    expect(ImageError, ref, tmp_path / "c", "climbs out of /disk", code="unsafe_path")


def test_qcow2_with_backing_file_is_refused(tmp_path: Path) -> None:
    base = make_qcow2(tmp_path / "base.qcow2")
    overlay = tmp_path / "overlay.qcow2"
    import subprocess

    subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(base), "-F", "qcow2", str(overlay)], check=True
    )
    expect(
        ImageError,
        f"file:{overlay}",
        tmp_path / "c",
        "names a backing file",
        "qemu-img convert",
        code="unsafe_disk",
    )
    with pytest.raises(ImageError, match="names a backing file"):
        write_layout(overlay, tmp_path / "layout")


def test_declared_qcow2_without_magic(tmp_path: Path) -> None:
    c = Crafter(layout=tmp_path / "layout")
    layer = c.blob(os.urandom(4096), "application/vnd.diskimage.qcow2", {TITLE: "x.qcow2"})
    ref = c.tag(c.manifest([layer]), "v")
    expect(
        ImageError,
        ref,
        tmp_path / "c",
        "declared qcow2 but does not start with the qcow2 magic",
        code="bad_disk",
    )


def test_corrupt_compressed_stream_with_matching_digest(tmp_path: Path) -> None:
    c = Crafter(layout=tmp_path / "layout")
    # a real frame (single segment: its window is its 16 KiB content) with the blocks garbled after
    # the header; random bytes after the magic sometimes declared a window past the cap instead
    frame = zstandard.ZstdCompressor(level=3).compress(bytes(range(256)) * 64)
    layer = c.blob(
        frame[:6] + bytes(b ^ 0x5A for b in frame[6:]), "application/vnd.diskimage.raw+zstd", {TITLE: "x.raw.zst"}
    )
    ref = c.tag(c.manifest([layer]), "v")
    expect(ImageError, ref, tmp_path / "c", "could not be decompressed (zstd", code="bad_compression")


def test_file_path_missing(tmp_path: Path) -> None:
    missing = tmp_path / "nope.qcow2"
    expect(
        ImageError,
        f"file:{missing}",
        tmp_path / "c",
        f"disk file {missing} does not exist",
        code="file_not_found",
    )


def test_relative_file_path_missing_names_where_it_was_looked_for(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # a spec file elsewhere with file:disk.qcow2 is read from the runtime's working directory
    monkeypatch.chdir(tmp_path)
    expect(
        ImageError,
        "file:nope.qcow2",
        tmp_path / "c",
        f"disk file nope.qcow2 ({tmp_path / 'nope.qcow2'}: relative to the runtime's working directory) "
        "does not exist",
        code="file_not_found",
    )


def test_layout_tag_missing_lists_tags(oci_qcow2: Path, tmp_path: Path) -> None:
    write_layout(oci_qcow2, tmp_path / "layout", tag="v1")
    expect(
        ImageError,
        f"oci-layout:{tmp_path / 'layout'}:v2",
        tmp_path / "c",
        "tag v2 not found in OCI layout",
        "(tags there: v1)",
        code="tag_not_found",
    )


def test_not_a_layout_directory(tmp_path: Path) -> None:
    expect(
        ImageError,
        f"oci-layout:{tmp_path}",
        tmp_path / "c",
        "is not an OCI image layout",
        code="layout_not_found",
    )


def test_unsupported_arch_name(tmp_path: Path) -> None:
    expect(
        PlatformError, "file:/x.qcow2", tmp_path / "c", "unsupported architecture 'riscv64'", arch="riscv64"
    )


def test_push_refuses_compressed_or_missing_disk_and_non_registry_refs(
    registry: RunningRegistry, oci_qcow2: Path, tmp_path: Path
) -> None:
    compressed = tmp_path / "d.qcow2.zst"
    compressed.write_bytes(zstandard.ZstdCompressor().compress(oci_qcow2.read_bytes()))
    with pytest.raises(ImageError, match="is zstd-compressed; decompress it first"):
        push_artifact(compressed, f"{registry.host}/err/push:1")
    with pytest.raises(ImageError, match="does not exist or is not a regular file"):
        push_artifact(tmp_path / "missing.qcow2", f"{registry.host}/err/push:1")
    with pytest.raises(BadReferenceError, match="not a registry reference"):
        push_artifact(oci_qcow2, f"oci-layout:{tmp_path}:x")
    with pytest.raises(BadReferenceError, match="pins a digest"):
        push_artifact(oci_qcow2, f"{registry.host}/err/push@sha256:{'a' * 64}")


@pytest.mark.parametrize("where", ["a-file", "/proc/vmsidecar-layout"])
def test_a_layout_directory_that_cannot_be_written_is_named_not_reported_as_a_crash(
    oci_qcow2: Path, tmp_path: Path, where: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``vmsidecar-oci layout DISK DIR`` where DIR is a file, or cannot be made: it said "unexpected
    NotADirectoryError …; report it", as for a bug."""
    from vmsidecar_runtime.oci.cli import main

    target = tmp_path / where if not where.startswith("/") else Path(where)
    if where == "a-file":
        target.write_text("not a directory\n")
    assert main(["layout", str(oci_qcow2), str(target)]) == 2
    err = capsys.readouterr().err
    assert f"error: cannot write an OCI layout into {target} (" in err and "unexpected" not in err, err
    assert "name a directory you can write" in err, err


@pytest.mark.parametrize("what", ["missing", "directory", "compressed"])
def test_a_disk_push_cannot_publish_is_named_before_the_registry_is_asked(tmp_path: Path, what: str) -> None:
    """The disk is checked before the network: a typo in its path was reported as the registry's
    being unreachable (after its retries) when both were wrong, and only then as itself."""
    disk = tmp_path / "disk.qcow2"
    if what == "directory":
        disk.mkdir()
    elif what == "compressed":
        disk.write_bytes(zstandard.ZstdCompressor().compress(b"\0" * 4096))
    started = time.monotonic()
    with pytest.raises(ImageError) as caught:
        push_artifact(disk, "127.0.0.1:1/vm/tiny:1")
    assert caught.value.code == ("compressed_input" if what == "compressed" else "disk_not_found"), caught.value.message
    assert str(disk) in caught.value.message and "unreachable" not in caught.value.message
    assert time.monotonic() - started < 2  # no registry retries first
    with pytest.raises(RegistryError, match=r"registry 127\.0\.0\.1:1 is unreachable"):  # a good disk: then the registry
        push_artifact(make_qcow2(tmp_path / "good.qcow2"), "127.0.0.1:1/vm/tiny:1")
