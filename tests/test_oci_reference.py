"""Reference parsing: the accepted forms, their round trip, and the refused ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from vmsidecar_contract.errors import BadReferenceError
from vmsidecar_runtime.oci import Reference, parse_reference
from vmsidecar_runtime.oci.reference import is_loopback_host

D = "sha256:" + "a" * 64


@pytest.mark.parametrize(
    ("text", "expected", "canonical"),
    [
        ("127.0.0.1:5000/vm/tiny:1", Reference("registry", "127.0.0.1:5000", "vm/tiny", "1"), None),
        ("localhost/tiny", Reference("registry", "localhost", "tiny"), None),
        (
            "localhost:5000/a/b/c:v1.2-rc_3",
            Reference("registry", "localhost:5000", "a/b/c", "v1.2-rc_3"),
            None,
        ),
        ("quay.io/podman/machine-os:5.3", Reference("registry", "quay.io", "podman/machine-os", "5.3"), None),
        ("reg.example.com/vm/tiny@" + D, Reference("registry", "reg.example.com", "vm/tiny", None, D), None),
        ("reg.example.com/vm/tiny:1@" + D, Reference("registry", "reg.example.com", "vm/tiny", "1", D), None),
        ("[::1]:5000/vm/tiny:1", Reference("registry", "[::1]:5000", "vm/tiny", "1"), None),
        (
            "oci://127.0.0.1:5000/vm/tiny:1",
            Reference("registry", "127.0.0.1:5000", "vm/tiny", "1"),
            "127.0.0.1:5000/vm/tiny:1",
        ),
        (
            "docker://quay.io/containerdisks/fedora:40",
            Reference("registry", "quay.io", "containerdisks/fedora", "40"),
            "quay.io/containerdisks/fedora:40",
        ),
        ("oci-layout:/srv/images", Reference("layout", path=Path("/srv/images")), None),
        ("oci-layout:/srv/images:v1", Reference("layout", tag="v1", path=Path("/srv/images")), None),
        ("oci-layout:rel/dir:latest", Reference("layout", tag="latest", path=Path("rel/dir")), None),
        ("oci-layout:/srv/images@" + D, Reference("layout", digest=D, path=Path("/srv/images")), None),
        ("file:/srv/disk.qcow2", Reference("file", path=Path("/srv/disk.qcow2")), None),
        (
            "file:///srv/disk.qcow2.zst",
            Reference("file", path=Path("/srv/disk.qcow2.zst")),
            "file:/srv/disk.qcow2.zst",
        ),
        ("/srv/disk.img", Reference("file", path=Path("/srv/disk.img")), "file:/srv/disk.img"),
        ("./disk.raw", Reference("file", path=Path("disk.raw")), "file:disk.raw"),
    ],
)
def test_parse_table(text: str, expected: Reference, canonical: str | None) -> None:
    ref = parse_reference(text)
    assert ref == expected
    assert str(ref) == (canonical or text)
    assert parse_reference(str(ref)) == ref


def test_bare_existing_file_and_layout_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "disk.qcow2").write_bytes(b"QFI\xfb")
    (tmp_path / "lay").mkdir()
    (tmp_path / "lay" / "oci-layout").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert parse_reference("disk.qcow2") == Reference("file", path=Path("disk.qcow2"))
    assert parse_reference(str(tmp_path / "lay")) == Reference("layout", path=tmp_path / "lay")


def test_manifest_ref_defaults_to_latest() -> None:
    assert parse_reference("localhost/x").manifest_ref == "latest"
    assert parse_reference("localhost/x:2").manifest_ref == "2"
    assert parse_reference(f"localhost/x:2@{D}").manifest_ref == D


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("ftp://x", "unknown scheme 'ftp'"),
        ("https://reg.example.com/x:1", "unknown scheme 'https'"),
        ("oci:/srv/dir:tag", "unknown scheme 'oci'"),
        ("foo/bar:1", "has no registry host; add it in front, as in 127.0.0.1:5000/foo/bar:1"),
        ("tiny:1", "has no registry host"),
        ("localhost:5000/Vm/Tiny:1", "invalid repository 'Vm/Tiny'"),
        ("localhost:5000/vm/tiny:-bad", "invalid tag '-bad'"),
        ("localhost:5000/vm/tiny@sha256:abc", "invalid digest 'sha256:abc'"),
        ("localhost:5000/vm/tiny@sha512:" + "a" * 128, "write @sha256: followed by 64 lowercase hex digits"),
        ("", "the image reference is empty"),
        ("oci-layout:", "names no directory"),
        ("file:", "names no file"),
    ],
)
def test_bad_references(text: str, needle: str) -> None:
    with pytest.raises(BadReferenceError) as info:
        parse_reference(text)
    assert needle in info.value.message
    assert info.value.code == "bad_reference"
    assert ";" in info.value.message  # cause; fix


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1:5000", True),
        ("127.1.2.3", True),
        ("localhost:5000", True),
        ("[::1]:5000", True),
        ("quay.io", False),
        ("10.0.0.1:5000", False),
        ("registry.local:5000", False),
    ],
)
def test_loopback_hosts_get_plain_http(host: str, loopback: bool) -> None:
    assert is_loopback_host(host) is loopback


@pytest.mark.parametrize("text", ["127.0.0.1\n/x:y", "169.254.169.254\n/x:y", "evil.example/x\n/y:t",
                                  "registry.example/v\rm:1", "registry.example/vm:1\x1b[2J",
                                  "registry.example\t/vm:1", "registry.example/vm\x00:1", "file:/tmp/x\n.qcow2"])
def test_a_reference_with_a_control_character_is_refused(text: str) -> None:
    """``$`` in the parts' patterns also matched before a final newline: ``127.0.0.1\\n`` passed as a
    host, which name resolution did not find, so the pod's own addresses were not recognised (only
    the HTTP library's own check kept the pull from connecting), and the newline reached log lines."""
    with pytest.raises(BadReferenceError, match="control character"):
        parse_reference(text, look=False)
    assert parse_reference(" registry.example/vm:1\n").registry == "registry.example"  # (the ends are trimmed)
