"""Every manifest we ship validates: Kubernetes objects against the Kubernetes schemas
(kubernetes-validate), the pool samples against upstream's real ExporterSet/VirtualTargetClass CRDs."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from vmsidecar_contract.spec import load_spec

ROOT = Path(__file__).parents[1]
CRDS = ROOT / "tests" / "data" / "upstream-crds"  # vendored; source and commit in its README
K8S_VERSION = "1.31"


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _crd_schema(kind: str) -> dict:
    for crd in CRDS.glob("*.yaml"):
        doc = yaml.safe_load(crd.read_text())
        if doc["spec"]["names"]["kind"] == kind:
            version = next(v for v in doc["spec"]["versions"] if v["name"] == "v1alpha1")
            return version["schema"]["openAPIV3Schema"]
    raise AssertionError(f"no CRD for {kind} in {CRDS}")


MANIFESTS = sorted((ROOT / "container" / "k8s").glob("*.yaml"))


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_manifest_validates(path: Path) -> None:
    for doc in _docs(path):
        if doc["apiVersion"].startswith("virtualtarget.jumpstarter.dev/"):
            jsonschema.validate(doc, _crd_schema(doc["kind"]))
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_pod_template_for_podman_validates() -> None:
    text = (ROOT / "container" / "pod.yaml").read_text()
    values = {"NAME": "vmsidecar", "PORT": "19090", "RECYCLE": "InPlaceReuse", "MEMORY": "512M",
              "IMAGE": "127.0.0.1:5000/vm/tiny:1", "RUNTIME_IMAGE": "r", "EXPORTER_IMAGE": "e"}
    for key, value in values.items():
        text = text.replace("${" + key + "}", value)
    for doc in yaml.safe_load_all(text):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_driver_specs_in_samples_are_valid_vm_specs() -> None:
    for path in MANIFESTS:
        for doc in _docs(path):
            if doc["kind"] == "ExporterSet":
                for driver in doc["spec"]["template"]["spec"]["drivers"]:
                    assert driver["config"]["recycle"] == doc["spec"]["recycleStrategy"]
                    load_spec(driver["config"]["spec"])


def test_a_bad_manifest_is_caught() -> None:
    bad = _docs(MANIFESTS[0])[0] | {"spec": {"recycleStrategy": "Sometimes"}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, _crd_schema(bad["kind"]))
