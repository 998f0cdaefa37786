"""The image carries its own readiness: ``vmsidecar-oci push/layout --readiness-*`` write the
``io.vmsidecar.readiness.*`` annotations (manifest and index entry), a pull carries them (also from
the cache), and the runtime uses them where the spec says nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fixtures.registry import Crafter, RunningRegistry
from vmsidecar_contract.errors import ImageError
from vmsidecar_runtime.oci import inspect, pull, push_artifact
from vmsidecar_runtime.oci.cli import main
from vmsidecar_runtime.oci.pack import readiness_annotations
from vmsidecar_runtime.oci.reference import parse_reference
from vmsidecar_runtime.oci.registry import RegistryClient

PATTERN = "io.vmsidecar.readiness.pattern"
TIMEOUT = "io.vmsidecar.readiness.timeout"
CONSOLE = "io.vmsidecar.readiness.console"


def _doc(registry: RunningRegistry, repo: str, ref: str) -> dict:
    return RegistryClient(parse_reference(f"{registry.host}/{repo}")).get_manifest(ref).json()


def test_push_and_layout_write_the_annotations(registry: RunningRegistry, oci_qcow2: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    ref = f"{registry.host}/ready/push:1"
    assert main(["push", str(oci_qcow2), ref, "--form", "containerdisk", "--readiness-pattern", "login: ",
                 "--readiness-console", "hvc0", "--readiness-timeout", "600"]) == 0
    want = {PATTERN: "login: ", CONSOLE: "hvc0", TIMEOUT: "600"}
    index = _doc(registry, "ready/push", "1")
    (entry,) = index["manifests"]
    assert entry["annotations"] == want
    assert _doc(registry, "ready/push", entry["digest"])["annotations"] == want
    assert inspect(ref, arch="x86_64")["annotations"] == want
    assert pull(ref, tmp_path / "cache", arch="x86_64").annotations == want

    capsys.readouterr()
    assert main(["layout", str(oci_qcow2), str(tmp_path / "lay"), "--readiness-pattern", ""]) == 0
    pulled = pull(f"oci-layout:{tmp_path / 'lay'}", tmp_path / "cache", arch="x86_64")
    assert pulled.annotations == {PATTERN: ""}  # empty: Ready as soon as the guest runs
    # without the options, nothing is annotated (the digests stay those of earlier releases)
    plain = push_artifact(oci_qcow2, f"{registry.host}/ready/plain:1")
    assert "annotations" not in _doc(registry, "ready/plain", plain)


@pytest.mark.parametrize(("args", "needle"), [
    (["--readiness-pattern", "("], "pattern: readiness pattern '(' is not a valid regex"),
    (["--readiness-timeout", "0"], "timeout: Input should be greater than 0"),
])
def test_bad_readiness_options_are_refused(args: list[str], needle: str, registry: RunningRegistry,
                                           oci_qcow2: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["push", str(oci_qcow2), f"{registry.host}/ready/bad:1", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: invalid readiness for the image") and needle in err
    with pytest.raises(ImageError) as exc:
        readiness_annotations(pattern="(")
    assert exc.value.code == "bad_readiness"


def test_pull_carries_the_annotations_of_the_chain_also_from_the_cache(
    registry: RunningRegistry, oci_qcow2: Path, tmp_path: Path
) -> None:
    craft = Crafter(registry=registry, repo="ready/chain")
    layer = craft.blob(oci_qcow2.read_bytes(), "application/vnd.diskimage.qcow2")
    manifest = craft.manifest([layer], artifact_type="application/vnd.diskimage.qcow2")
    amd64 = {"os": "linux", "architecture": "amd64"}
    first = craft.tag(craft.index([(manifest, amd64, {PATTERN: "one", "other.key": "x"})]), "one")
    second = craft.tag(craft.index([(manifest, amd64, {PATTERN: "two"})]), "two")
    cache = tmp_path / "cache"
    fresh = pull(first, cache, arch="x86_64")
    assert (fresh.cached, fresh.annotations) == (False, {PATTERN: "one"})  # only io.vmsidecar.* travel
    assert pull(first, cache, arch="x86_64").annotations == {PATTERN: "one"}  # cached by tag
    other = pull(second, cache, arch="x86_64")  # same manifest and layer, another index entry
    assert (other.cached, other.annotations) == (True, {PATTERN: "two"})
    pinned = pull(f"{registry.host}/ready/chain@{manifest['digest']}", cache, arch="x86_64")
    assert pinned.annotations == {}  # the manifest alone says nothing

    # a cache written before annotations were kept: resolved again, not taken as "no annotations"
    index_path = cache / "index.json"
    entries = json.loads(index_path.read_text())
    for entry in entries.values():
        if isinstance(entry, dict):  # "used:" keys hold a time (the cache budget's LRU)
            entry.pop("annotations", None)
    index_path.write_text(json.dumps(entries))
    assert pull(first, cache, arch="x86_64").annotations == {PATTERN: "one"}


async def test_the_runtime_uses_what_the_image_says(registry: RunningRegistry, tiny_image: Any,
                                                    start_runtime: Any) -> None:
    ref = f"{registry.host}/ready/tiny:1"
    push_artifact(tiny_image.disk, ref, annotations=readiness_annotations("vm# ", timeout=150))
    rt = await start_runtime({"image": ref, "memory": "256M", "snapshot": "off"})
    state = await rt.client().wait_ready(180)
    assert state.readiness_source == "image" and state.readiness is not None
    assert (state.readiness.pattern, state.readiness.console, state.readiness.timeout) == ("vm# ", "ttyS0", 150)


async def test_invalid_image_readiness_is_an_error_unless_the_spec_overrides_it(
    registry: RunningRegistry, tiny_image: Any, start_runtime: Any
) -> None:
    craft = Crafter(registry=registry, repo="ready/broken")
    layer = craft.blob(tiny_image.disk.read_bytes(), "application/vnd.diskimage.qcow2")
    ref = craft.tag(craft.manifest([layer], artifact_type="application/vnd.diskimage.qcow2"), "1")
    # the annotation goes on the manifest itself: no index here
    client = RegistryClient(parse_reference(f"{registry.host}/ready/broken"))
    doc = client.get_manifest("1").json() | {"annotations": {PATTERN: "(", TIMEOUT: "soon"}}
    data = json.dumps(doc).encode()
    client.put_manifest("1", data, doc["mediaType"])

    rt = await start_runtime({"image": ref, "memory": "256M", "snapshot": "off"}, name="broken")
    with pytest.raises(ImageError) as exc:
        await rt.client().wait_ready(120)
    assert exc.value.code == "bad_readiness", exc.value
    message = str(exc.value)
    assert f"{PATTERN}: readiness pattern '(' is not a valid regex" in message and TIMEOUT in message
    assert "or set readiness in the spec" in message

    fixed = await start_runtime({"image": ref, "memory": "256M", "snapshot": "off"}, name="fixed",
                                extra_args=["--ready-pattern", "vm# ", "--ready-timeout", "120"])
    state = await fixed.client().wait_ready(180)
    assert state.readiness_source == "spec"
