"""Push → pull round trips against a real docker-registry, OCI layouts, skopeo interop, platforms."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import lzma
import os
import stat
import subprocess
import tarfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import zstandard

from fixtures.registry import Crafter, RunningRegistry, make_qcow2
from vmsidecar_runtime.oci import parse_reference, pull, push_artifact, push_containerdisk, write_layout
from vmsidecar_runtime.oci.registry import RegistryClient, RegistrySource


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def tar_bytes(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def get_json(registry: RunningRegistry, ref: str) -> dict:
    r = parse_reference(ref)
    return (
        RegistryClient(parse_reference(f"{registry.host}/{r.repository}")).get_manifest(r.manifest_ref).json()
    )


def assert_read_only_in(disk_path: Path, cache: Path) -> None:
    assert disk_path.is_relative_to(cache / "disks")
    assert stat.S_IMODE(disk_path.stat().st_mode) == 0o444
    assert list((cache / "tmp").iterdir()) == []


def test_push_artifact_then_pull_is_byte_identical(
    registry: RunningRegistry, oci_qcow2: Path, tmp_path: Path
) -> None:
    ref = f"{registry.host}/rt/artifact:1"
    manifest_digest = push_artifact(oci_qcow2, ref)
    cache = tmp_path / "cache"
    disk = pull(ref, cache, arch="x86_64")
    original = oci_qcow2.read_bytes()
    assert disk.path.read_bytes() == original
    assert disk.digest == sha(original)
    assert (disk.format, disk.size, disk.manifest_digest, disk.cached) == (
        "qcow2",
        len(original),
        manifest_digest,
        False,
    )
    assert 0 < disk.bytes_downloaded < len(original)  # zstd layer
    assert disk.reference == ref
    assert_read_only_in(disk.path, cache)

    index = get_json(registry, ref)
    assert index["mediaType"] == "application/vnd.oci.image.index.v1+json"
    [entry] = index["manifests"]
    assert entry["platform"] == {"architecture": "amd64", "os": "linux"}
    assert entry["digest"] == manifest_digest
    manifest = get_json(registry, f"{ref}@{manifest_digest}")
    assert manifest["artifactType"] == "application/vnd.diskimage.qcow2"
    assert manifest["config"]["mediaType"] == "application/vnd.oci.empty.v1+json"
    [layer] = manifest["layers"]
    assert layer["mediaType"] == "application/vnd.diskimage.qcow2+zstd"
    assert layer["annotations"] == {
        "org.opencontainers.image.title": "tiny.qcow2.zst",
        "io.vmsidecar.disk.digest": sha(original),
        "io.vmsidecar.disk.size": str(len(original)),
    }


def test_second_pull_transfers_zero_blob_bytes(
    registry: RunningRegistry, oci_qcow2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = f"{registry.host}/rt/cached:1"
    digest = push_artifact(oci_qcow2, ref)
    cache = tmp_path / "cache"
    first = pull(ref, cache)
    assert first.bytes_downloaded > 0 and not first.cached

    def no_blobs(self: object, descriptor: dict) -> None:
        raise AssertionError(f"blob {descriptor['digest']} fetched again")

    monkeypatch.setattr(RegistrySource, "open_blob", no_blobs)
    again = pull(ref, cache)
    assert (again.cached, again.bytes_downloaded, again.path, again.digest) == (
        True,
        0,
        first.path,
        first.digest,
    )
    # a pinned digest costs one manifest GET: the registry must still authorise it (docs/oci.md)
    asked = []
    top = RegistrySource.top
    monkeypatch.setattr(RegistrySource, "top", lambda self: asked.append(1) or top(self))
    pinned = pull(f"{registry.host}/rt/cached@{digest}", cache)
    assert (pinned.cached, pinned.bytes_downloaded, pinned.path, len(asked)) == (True, 0, first.path, 1)


@pytest.mark.parametrize("compression", ["gzip", None])
def test_artifact_other_compressions(
    registry: RunningRegistry, oci_qcow2: Path, tmp_path: Path, compression: str | None
) -> None:
    ref = f"{registry.host}/rt/compression:{compression or 'none'}"
    push_artifact(oci_qcow2, ref, compression=compression)
    disk = pull(ref, tmp_path / "cache")
    assert disk.path.read_bytes() == oci_qcow2.read_bytes()


def test_push_containerdisk_then_pull_is_byte_identical(
    registry: RunningRegistry, oci_qcow2: Path, tmp_path: Path
) -> None:
    ref = f"{registry.host}/rt/containerdisk:1"
    manifest_digest = push_containerdisk(oci_qcow2, ref)
    disk = pull(ref, tmp_path / "cache", arch="amd64")
    assert disk.path.read_bytes() == oci_qcow2.read_bytes()
    assert (disk.format, disk.manifest_digest) == ("qcow2", manifest_digest)
    manifest = get_json(registry, f"{ref}@{manifest_digest}")
    assert manifest["config"]["mediaType"] == "application/vnd.oci.image.config.v1+json"
    assert [la["mediaType"] for la in manifest["layers"]] == ["application/vnd.oci.image.layer.v1.tar+gzip"]


def test_containerdisk_layer_is_kubevirt_shaped(oci_qcow2: Path, tmp_path: Path) -> None:
    layout = tmp_path / "layout"
    manifest_digest = write_layout(oci_qcow2, layout, tag="cd", form="containerdisk", arch="aarch64")
    blobs = layout / "blobs" / "sha256"
    manifest = json.loads((blobs / manifest_digest[7:]).read_bytes())
    config = json.loads((blobs / manifest["config"]["digest"][7:]).read_bytes())
    layer = (blobs / manifest["layers"][0]["digest"][7:]).read_bytes()
    assert (config["architecture"], config["os"]) == ("arm64", "linux")
    assert config["rootfs"]["diff_ids"] == [sha(gzip.decompress(layer))]
    with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
        members = {m.name: m for m in tar.getmembers()}
    disk = members["disk/tiny.qcow2"]
    assert (disk.uid, disk.gid, stat.S_IMODE(disk.mode), disk.size) == (
        107,
        107,
        0o440,
        oci_qcow2.stat().st_size,
    )
    assert set(members) == {"disk", "disk/tiny.qcow2"}


@pytest.mark.parametrize("form", ["artifact", "containerdisk"])
def test_write_layout_then_pull_from_layout(oci_qcow2: Path, tmp_path: Path, form: str) -> None:
    layout = tmp_path / "layout"
    digest = write_layout(oci_qcow2, layout, tag="v1", form=form)  # type: ignore[arg-type]
    cache = tmp_path / "cache"
    disk = pull(f"oci-layout:{layout}:v1", cache, arch="x86_64")
    assert disk.path.read_bytes() == oci_qcow2.read_bytes()
    assert disk.manifest_digest == digest
    assert_read_only_in(disk.path, cache)
    again = pull(f"oci-layout:{layout}:v1", cache, arch="x86_64")
    assert (again.cached, again.bytes_downloaded) == (True, 0)
    assert json.loads((layout / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}
    # a bare layout directory with one tag resolves to it
    assert pull(str(layout), cache, arch="x86_64").digest == disk.digest


@pytest.mark.parametrize("form", ["artifact", "containerdisk"])
def test_skopeo_reads_our_layout_and_copies_it(
    registry: RunningRegistry, oci_qcow2: Path, tmp_path: Path, form: str
) -> None:
    layout = tmp_path / "layout"
    digest = write_layout(oci_qcow2, layout, tag="t1", form=form)  # type: ignore[arg-type]
    raw = subprocess.run(
        ["skopeo", "inspect", "--raw", f"oci:{layout}:t1"], check=True, capture_output=True, text=True
    ).stdout
    index = json.loads(raw)
    assert [m["digest"] for m in index["manifests"]] == [digest]
    dest = f"{registry.host}/interop/{form}:y"
    subprocess.run(
        ["skopeo", "copy", "--quiet", f"oci:{layout}:t1", f"docker://{dest}", "--dest-tls-verify=false"],
        check=True,
        capture_output=True,
        text=True,
    )
    disk = pull(dest, tmp_path / "cache", arch="x86_64")
    assert disk.path.read_bytes() == oci_qcow2.read_bytes()
    assert disk.manifest_digest == digest  # skopeo copied our manifest verbatim


def test_two_arch_index_selects_by_platform(
    registry: RunningRegistry, oci_qcow2: Path, tmp_path: Path
) -> None:
    arm_disk = make_qcow2(tmp_path / "arm.qcow2", pattern=0xCD)
    ref = f"{registry.host}/rt/multiarch:1"
    amd = push_artifact(oci_qcow2, ref, arch="x86_64")
    arm = push_containerdisk(arm_disk, ref, arch="arm64")
    amd_again = push_artifact(oci_qcow2, ref, arch="amd64")  # replaces the amd64 entry, keeps arm64
    assert amd_again == amd
    index = get_json(registry, ref)
    assert {m["platform"]["architecture"]: m["digest"] for m in index["manifests"]} == {
        "amd64": amd,
        "arm64": arm,
    }
    cache = tmp_path / "cache"
    x86 = pull(ref, cache, arch="x86_64")
    aarch = pull(ref, cache, arch="aarch64")
    assert x86.path.read_bytes() == oci_qcow2.read_bytes()
    assert aarch.path.read_bytes() == arm_disk.read_bytes()
    assert (x86.manifest_digest, aarch.manifest_digest) == (amd, arm)


def _zstd(data: bytes) -> bytes:
    return zstandard.ZstdCompressor().compress(data)


def test_podman_machine_style_index_prefers_disktype_qemu(
    registry: RunningRegistry, oci_qcow2: Path, tmp_path: Path
) -> None:
    c = Crafter(registry=registry, repo="podman/machine-os")
    qcow2 = oci_qcow2.read_bytes()
    raw = os.urandom(64 * 1024)
    entries = []
    for arch in ("x86_64", "aarch64"):
        for disktype, data, ext in (
            ("applehv", raw, "raw"),
            ("qemu", qcow2, "qcow2"),
            ("hyperv", raw, "vhdx"),
        ):
            layer = c.blob(
                _zstd(data),
                "application/zstd",
                {"org.opencontainers.image.title": f"podman-machine.{arch}.{disktype}.{ext}.zst"},
            )
            entries.append(
                (c.manifest([layer]), {"architecture": arch, "os": "linux"}, {"disktype": disktype})
            )
    ref = c.tag(c.index(entries), "5.3")
    disk = pull(ref, tmp_path / "cache", arch="amd64")
    assert (disk.format, disk.path.read_bytes()) == ("qcow2", qcow2)
    assert disk.manifest_digest == entries[1][0]["digest"]


def test_docker_manifest_list_with_containerdisk(registry: RunningRegistry, tmp_path: Path) -> None:
    c = Crafter(registry=registry, repo="docker/list")
    raw = os.urandom(128 * 1024)
    layer_tar = tar_bytes({"disk/disk.img": raw})
    layer = c.blob(gzip.compress(layer_tar), "application/vnd.docker.image.rootfs.diff.tar.gzip")
    config = c.image_config("amd64", [sha(layer_tar)], "application/vnd.docker.container.image.v1+json")
    manifest = c.manifest(
        [layer], config=config, media_type="application/vnd.docker.distribution.manifest.v2+json"
    )
    other = c.manifest(
        [layer],
        config=c.image_config("arm64", [sha(layer_tar)], "application/vnd.docker.container.image.v1+json"),
        media_type="application/vnd.docker.distribution.manifest.v2+json",
    )
    index = c.index(
        [
            (other, {"architecture": "arm64", "os": "linux", "variant": "v8"}, None),
            (manifest, {"architecture": "amd64", "os": "linux"}, None),
        ],
        media_type="application/vnd.docker.distribution.manifest.list.v2+json",
    )
    disk = pull(c.tag(index, "1"), tmp_path / "cache", arch="x86_64")
    assert (disk.format, disk.path.read_bytes(), disk.manifest_digest) == ("raw", raw, manifest["digest"])


@pytest.mark.parametrize(
    ("media_type", "compress", "name"),
    [
        ("application/vnd.oci.image.layer.v1.tar", lambda b: b, "/disk/root.qcow2"),
        ("application/vnd.oci.image.layer.v1.tar+zstd", _zstd, "./disk/root.qcow2"),
        ("application/vnd.oci.image.layer.v1.tar+gzip", gzip.compress, "disk/root.img"),
    ],
)
def test_containerdisk_layer_variants(
    oci_qcow2: Path, tmp_path: Path, media_type: str, compress: object, name: str
) -> None:
    c = Crafter(layout=tmp_path / "layout")
    data = oci_qcow2.read_bytes()
    tar_data = tar_bytes({"etc/hostname": b"x\n", name: data, "disk/README.txt": b"not a disk"})
    layer = c.blob(compress(tar_data), media_type)  # type: ignore[operator]
    manifest = c.manifest([layer], config=c.image_config("amd64", [sha(tar_data)]))
    disk = pull(c.tag(manifest, "v"), tmp_path / "cache", arch="x86_64")
    assert (disk.format, disk.path.read_bytes()) == ("qcow2", data)


def test_multi_layer_containerdisk_takes_the_disk_from_its_layer(oci_qcow2: Path, tmp_path: Path) -> None:
    c = Crafter(layout=tmp_path / "layout")
    base = tar_bytes({"etc/os-release": b"ID=scratch\n"})
    top = tar_bytes({"disk/root.qcow2": oci_qcow2.read_bytes()})
    manifest = c.manifest(
        [
            c.blob(top, "application/vnd.oci.image.layer.v1.tar"),
            c.blob(base, "application/vnd.oci.image.layer.v1.tar"),
        ],
        config=c.image_config("amd64", [sha(top), sha(base)]),
    )
    disk = pull(c.tag(manifest, "v"), tmp_path / "cache", arch="x86_64")
    assert disk.path.read_bytes() == oci_qcow2.read_bytes()


@pytest.mark.parametrize(
    ("media_type", "title", "compress"),
    [
        ("application/octet-stream", "root.qcow2.gz", gzip.compress),
        ("application/octet-stream", "root.qcow2", lambda b: b),
        ("application/gzip", "root.img.gz", gzip.compress),
        ("application/zstd", "root.qcow2.zst", _zstd),
    ],
)
def test_generic_blob_types_with_disk_titles(
    oci_qcow2: Path, tmp_path: Path, media_type: str, title: str, compress: object
) -> None:
    c = Crafter(layout=tmp_path / "layout")
    data = oci_qcow2.read_bytes()
    layer = c.blob(compress(data), media_type, {"org.opencontainers.image.title": title})  # type: ignore[operator]
    disk = pull(c.tag(c.manifest([layer]), "v"), tmp_path / "cache")
    assert (disk.format, disk.path.read_bytes()) == ("qcow2", data)


@pytest.mark.parametrize(
    ("suffix", "compress"),
    [("", lambda b: b), (".zst", _zstd), (".gz", gzip.compress), (".xz", lzma.compress)],
)
def test_file_references(oci_qcow2: Path, tmp_path: Path, suffix: str, compress: object) -> None:
    data = oci_qcow2.read_bytes()
    src = tmp_path / f"disk.qcow2{suffix}"
    src.write_bytes(compress(data))  # type: ignore[operator]
    cache = tmp_path / "cache"
    disk = pull(f"file:{src}", cache)
    assert (disk.format, disk.path.read_bytes(), disk.manifest_digest) == ("qcow2", data, None)
    assert disk.bytes_downloaded == src.stat().st_size
    assert_read_only_in(disk.path, cache)
    again = pull(str(src), cache)  # bare path, same file: cached without reading it
    assert (again.cached, again.bytes_downloaded, again.path) == (True, 0, disk.path)


def test_a_file_rewritten_in_place_with_its_times_kept_is_read_again(tmp_path: Path) -> None:
    """A raw disk edited in place keeps its inode and size; `rsync --inplace --times`, `touch -r` or a
    tool that restores the times keeps its mtime too: the cache must not hand back the old disk. Its
    ctime, which nothing sets back, moved."""
    src = tmp_path / "disk.raw"
    old = b"\xaa" * (256 * 1024)
    src.write_bytes(old)
    cache = tmp_path / "cache"
    first = pull(f"file:{src}", cache)
    st = src.stat()
    with open(src, "r+b") as f:  # in place: same inode, same size
        f.write(b"\x55" * 4096)
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))  # the times as they were
    now = src.stat()
    assert (now.st_ino, now.st_size, now.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)
    again = pull(f"file:{src}", cache)
    assert not again.cached and again.digest != first.digest, (again, first)
    assert again.path.read_bytes() == src.read_bytes() and first.path.read_bytes() == old


def test_raw_file_and_image_volume_directory(tmp_path: Path) -> None:
    data = os.urandom(256 * 1024)
    volume = tmp_path / "volume"
    (volume / "disk").mkdir(parents=True)
    (volume / "disk" / "root.img").write_bytes(data)
    disk = pull(f"file:{volume}", tmp_path / "cache")
    assert (disk.format, disk.path.read_bytes()) == ("raw", data)


def test_concurrent_pulls_download_once(registry: RunningRegistry, tmp_path: Path) -> None:
    disk_file = make_qcow2(tmp_path / "conc.qcow2", pattern=0x5A, length="2M")
    ref = f"{registry.host}/rt/concurrent:1"
    push_artifact(disk_file, ref)
    cache = tmp_path / "cache"
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda _: pull(ref, cache), range(4)))
    assert len({r.path for r in results}) == 1
    assert sum(1 for r in results if r.bytes_downloaded > 0) == 1
    assert results[0].path.read_bytes() == disk_file.read_bytes()
    assert list((cache / "tmp").iterdir()) == []


def test_progress_is_reported(registry: RunningRegistry, oci_qcow2: Path, tmp_path: Path) -> None:
    ref = f"{registry.host}/rt/progress:1"
    push_artifact(oci_qcow2, ref, compression=None)
    seen: list[tuple[int, int | None]] = []
    disk = pull(ref, tmp_path / "cache", progress=lambda done, total: seen.append((done, total)))
    assert seen and seen[-1] == (disk.bytes_downloaded, disk.bytes_downloaded)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
