"""The VM spec: parsing, defaults, and the messages bad fields get."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from vmsidecar_contract.errors import SpecError
from vmsidecar_contract.spec import load_spec, load_spec_text, parse_size_mib, spec_from_sources


@pytest.mark.parametrize(("text", "mib"), [("512M", 512), ("1G", 1024), ("1GiB", 1024), ("2048", 2048), (256, 256)])
def test_sizes(text: str | int, mib: int) -> None:
    assert parse_size_mib(text) == mib


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"memory": "12Q"}, "memory: '12Q' is not a size; write it like 512M"),
        ({"memory": "8M"}, "below the 16 MiB minimum"),
        ({"cpus": 0}, "cpus: Input should be greater than or equal to 1"),
        ({"arch": "sparc"}, "arch: unsupported architecture 'sparc'; use one of x86_64"),
        ({"acel": "kvm"}, "acel: unknown field; check the spelling"),
        ({"accel": "hvf"}, "accel: must be 'auto', 'kvm' or 'tcg'"),
        ({"readiness": {"pattern": "("}}, "is not a valid regex"),
        ({"initrd": "/x"}, "initrd and cmdline need kernel"),
        ({"arch": "aarch64"}, "aarch64 has no BIOS; set firmware: uefi"),
        ({"network": {"forwards": [{"name": "a", "guest_port": 1}, {"name": "a", "guest_port": 2}]}}, "must be unique"),
        ({"network": {"forwards": [{"name": "Bad Name", "guest_port": 22}]}}, "is not a valid name"),
        # a repository to search by the image's digest: never a tag or digest of someone's choosing
        ({"snapshot_source": "registry:5000/snaps:latest"}, "is not a repository; write REGISTRY/REPO, without a tag"),
        ({"snapshotSource": "registry:5000/snaps@sha256:" + "a" * 64}, "is not a repository; write REGISTRY/REPO"),
        ({"cpu": "max,+vmx"}, "cpu: 'max,+vmx' is not a QEMU CPU model name; name one model"),
        # QEMU's option syntax: a comma would add an option to -object can-host-socketcan
        ({"can": [{"name": "c0", "mode": "native", "host_interface": "vcan0,canbus=q"}]},
         "is not a network interface name"),
        ({"can": [{"name": "c0", "mode": "native", "host_interface": "../../x"}]}, "is not a network interface name"),
    ],
)
def test_bad_fields_name_the_field_and_fix(data: dict, message: str) -> None:
    with pytest.raises(SpecError) as exc:
        load_spec(data)
    assert message in str(exc.value)
    assert str(exc.value).startswith("invalid VM spec: ")


def test_camel_case_and_floats_from_jumpstarter() -> None:
    spec = load_spec({"cpus": 2.0, "memory": 1024.0, "network": {"forwards": [{"name": "ssh", "guestPort": 22.0}]}})
    assert spec.cpus == 2 and spec.memory == 1024
    assert spec.network.forwards[0].guest_port == 22


def test_layers_file_env_flags(tmp_path: Path) -> None:
    f = tmp_path / "spec.yaml"
    f.write_text("image: file:/a.qcow2\ncpus: 2\nmemory: 256M\n")
    spec = spec_from_sources(f, {"cpus": 3}, env={"VMSIDECAR_MEMORY": "1G"})
    assert (spec.image, spec.cpus, spec.memory) == ("file:/a.qcow2", 3, 1024)


def test_every_top_level_choice_a_podman_run_may_want_to_turn_off_is_an_environment_variable() -> None:
    """``snapshot: off`` from the environment, as ``standby`` and the rest: ``podman run -e
    VMSIDECAR_SNAPSHOT=off`` was ignored (serve warned, suggesting VMSIDECAR_SNAPSHOT_FORM, which is
    something else) and the runtime captured."""
    spec = spec_from_sources(None, env={"VMSIDECAR_IMAGE": "file:/a.qcow2", "VMSIDECAR_SNAPSHOT": "off"})
    assert spec.snapshot == "off"
    with pytest.raises(SpecError, match="snapshot"):
        spec_from_sources(None, env={"VMSIDECAR_IMAGE": "file:/a.qcow2", "VMSIDECAR_SNAPSHOT": "never"})


def test_standby_is_false_true_or_parked_from_every_source_and_anything_else_is_named() -> None:
    env = {"VMSIDECAR_IMAGE": "file:/a.qcow2"}
    assert spec_from_sources(None, env=env).standby is False
    assert spec_from_sources(None, env={**env, "VMSIDECAR_STANDBY": "true"}).standby is True
    assert spec_from_sources(None, env={**env, "VMSIDECAR_STANDBY": "Parked"}).standby == "parked"
    assert load_spec_text("image: file:/a.qcow2\nstandby: parked\n", "x.yaml").standby == "parked"
    assert load_spec_text("image: file:/a.qcow2\nstandby: yes\n", "x.yaml").standby is True
    for wrong in ("park", "spare", 2, None):
        with pytest.raises(SpecError, match=r'is not a standby; use false .*"parked" .* or true'):
            load_spec({"image": "file:/a.qcow2", "standby": wrong})


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="cannot read spec file"):
        spec_from_sources(tmp_path / "missing.yaml", env={})
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec_text("cpus: [1", "x.yaml")
    with pytest.raises(SpecError, match="must be a mapping"):
        load_spec_text("- 1\n- 2", "x.yaml")


def test_a_json_spec_reads_as_its_yaml_twin_without_loading_a_yaml_parser() -> None:
    """Launchers write JSON (RuntimeProcess): JSON is read as
    JSON, so a warm start imports no YAML parser; JSON's non-numbers are refused as YAML refuses them."""
    as_json = load_spec_text('{"image": "file:/d.qcow2", "memory": "512M", "cpus": 2}', "spec.json")
    assert as_json == load_spec_text("image: file:/d.qcow2\nmemory: 512M\ncpus: 2\n", "spec.yaml")
    with pytest.raises(SpecError, match="cpus"):
        load_spec_text('{"cpus": NaN}', "spec.json")
    with pytest.raises(SpecError, match="not valid YAML/JSON"):
        load_spec_text('{"cpus": 2,', "spec.json")
    code = ("import sys; from vmsidecar_contract.spec import load_spec_text; "
            "load_spec_text('{\"memory\": \"256M\"}'); print('yaml' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
