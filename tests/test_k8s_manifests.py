"""Every manifest we ship validates: Kubernetes objects against the Kubernetes schemas
(kubernetes-validate), the pool samples against upstream's real ExporterSet/VirtualTargetClass CRDs."""

from __future__ import annotations

import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from vmsidecar_contract.spec import load_spec
from vmsidecar_runtime.image.limits import parse_size
from vmsidecar_runtime.oci.cache import BUDGET_ENV, DEFAULT_BUDGET

ROOT = Path(__file__).parents[1]
CRDS = ROOT / "tests" / "data" / "upstream-crds"  # vendored; source and commit in its README
MONITORING_CRDS = ROOT / "tests" / "data" / "prometheus-operator-crds"  # the same, for the PodMonitor
K8S_VERSION = "1.31"


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _crd_schema(kind: str, api_version: str = "virtualtarget.jumpstarter.dev/v1alpha1") -> dict:
    group, _, name = api_version.partition("/")
    for crd in [*CRDS.glob("*.yaml"), *MONITORING_CRDS.glob("*.yaml")]:
        doc = yaml.safe_load(crd.read_text())
        if doc["spec"]["group"] == group and doc["spec"]["names"]["kind"] == kind:
            version = next(v for v in doc["spec"]["versions"] if v["name"] == name)
            return version["schema"]["openAPIV3Schema"]
    raise AssertionError(f"no CRD for {api_version} {kind} in {CRDS} or {MONITORING_CRDS}")


MANIFESTS = sorted((ROOT / "container" / "k8s").glob("*.yaml"))


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_manifest_validates(path: Path) -> None:
    for doc in _docs(path):
        if doc["apiVersion"].startswith(("virtualtarget.jumpstarter.dev/", "monitoring.coreos.com/")):
            jsonschema.validate(doc, _crd_schema(doc["kind"], doc["apiVersion"]))
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_pod_template_for_podman_validates() -> None:
    text = (ROOT / "container" / "pod.yaml").read_text()
    values = {"NAME": "vmsidecar", "PORT": "19090", "HEALTH_PORT": "8081", "RECYCLE": "InPlaceReuse", "MEMORY": "512M",
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


#: every container we ship runs like this (docs/security.md); upstream's pool pods are the provisioner's
LEAST_PRIVILEGE = {
    "runAsUser": 65532, "runAsGroup": 65532, "runAsNonRoot": True, "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]}, "readOnlyRootFilesystem": True, "seccompProfile": {"type": "RuntimeDefault"},
}
#: what each container writes, so each must be a volume under a read-only root filesystem
WRITABLE = {"runtime": {"/shared", "/var/lib/vmsidecar/cache", "/var/lib/vmsidecar/state", "/tmp"},
            "exporter": {"/shared", "/tmp"}}


def _pod_specs() -> dict[str, dict]:
    """Every Pod we ship: container/pod.yaml as scripts/pod renders it, and the Kubernetes samples."""
    rendered = subprocess.run([str(ROOT / "scripts" / "pod"), "render", "--image", "127.0.0.1:5000/vm/tiny:1"],
                              cwd=ROOT, capture_output=True, text=True, check=True).stdout
    pods = {"pod.yaml": next(d for d in yaml.safe_load_all(rendered) if d["kind"] == "Pod")}
    pods |= {path.name: doc for path in MANIFESTS for doc in _docs(path) if doc["kind"] == "Pod"}
    assert set(pods) == {"pod.yaml", "pod-sidecar.yaml"}
    return {name: doc["spec"] for name, doc in pods.items()}


def _covered(path: str, mounts: list[dict]) -> bool:
    return any(path == m["mountPath"] or m["mountPath"].startswith(path + "/") for m in mounts if not m.get("readOnly"))


@pytest.mark.parametrize("name", ["pod.yaml", "pod-sidecar.yaml"])
def test_every_container_runs_with_least_privilege(name: str) -> None:
    spec = _pod_specs()[name]
    containers = spec.get("initContainers", []) + spec["containers"]
    assert {c["name"] for c in containers} == {"runtime", "exporter"}
    for c in containers:
        assert c["securityContext"] == LEAST_PRIVILEGE, c["name"]
        missing = {p for p in WRITABLE[c["name"]] if not _covered(p, c["volumeMounts"])}
        assert not missing, f"{name}: {c['name']} writes {missing} on a read-only root filesystem"
    assert spec["securityContext"]["fsGroup"] == 65532  # Kubernetes: the cache volume is the runtime's group's
    assert not spec.get("hostNetwork") and not spec.get("hostPID")


def test_the_kubernetes_pod_carries_no_api_token_and_no_service_links() -> None:
    """A pool pod is driven by lease holders: a service account token mounted in it (the default)
    would be one more credential within their reach, and neither container uses the API."""
    spec = _pod_specs()["pod-sidecar.yaml"]
    assert spec.get("automountServiceAccountToken") is False and spec.get("enableServiceLinks") is False


def test_rendered_pod_validates() -> None:
    for doc in _pod_specs().values():
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": doc},
                                     K8S_VERSION, strict=True)


def test_the_pool_pods_security_is_the_provisioners() -> None:
    """The pool samples cannot set a securityContext: upstream's CRDs have no such field and its
    provisioner renders the pods (runtime as UID 0). If a newer CRD adds one, set it in the samples."""
    for crd in CRDS.glob("*.yaml"):
        assert "securityContext" not in crd.read_text(), crd.name


@pytest.mark.parametrize("name", ["pod.yaml", "pod-sidecar.yaml"])
def test_every_emptydir_is_bounded_and_the_cache_budget_fits_its_volume(name: str) -> None:
    """A guest's writes, flashes and logs, and the image cache, cannot fill the node (issue 19 item 8)."""
    spec = _pod_specs()[name]
    empty_dirs = [v for v in spec["volumes"] if "emptyDir" in v]
    # scripts/pod renders pod.yaml's emptyDirs with the pod's name in front (vmsidecar-shared)
    assert {v["name"].removeprefix("vmsidecar-") for v in empty_dirs} >= {"shared", "state"}
    for volume in empty_dirs:
        assert volume["emptyDir"].get("sizeLimit"), f"{name}: emptyDir {volume['name']} has no sizeLimit"
    runtime = next(c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == "runtime")
    env = {e["name"]: e.get("value") for e in runtime.get("env", [])}
    budget = parse_size(env[BUDGET_ENV]) if BUDGET_ENV in env else DEFAULT_BUDGET
    cache = next(v for v in spec["volumes"] if v["name"] == "cache")
    claim = cache.get("ephemeral", {}).get("volumeClaimTemplate", {}).get("spec", {})
    if request := claim.get("resources", {}).get("requests", {}).get("storage"):
        # room left for a pull in progress and a snapshot being captured
        assert budget <= parse_size(request) * 0.85, f"{name}: cache budget {budget} over its {request} volume"


#: where the runtime serves its health-only listener in every pod we ship (api/health.py)
HEALTH_PORT = 8081


def _runtime_container(spec: dict) -> dict:
    return next(c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == "runtime")


def _podman_template() -> dict:
    """container/pod.yaml itself (what Kubernetes would run), before scripts/pod adapts it to podman."""
    text = (ROOT / "container" / "pod.yaml").read_text()
    for key in ("NAME", "PORT", "HEALTH_PORT", "RECYCLE", "MEMORY", "IMAGE", "RUNTIME_IMAGE", "EXPORTER_IMAGE"):
        text = text.replace("${" + key + "}", {"PORT": "19090", "HEALTH_PORT": str(HEALTH_PORT)}.get(key, "x"))
    return next(d for d in yaml.safe_load_all(text) if d["kind"] == "Pod")["spec"]


@pytest.mark.parametrize("name", ["pod.yaml", "pod-sidecar.yaml"])
def test_the_runtimes_probes_are_http_gets_on_the_health_port(name: str) -> None:
    """Issue 21 item 2: an exec of ``vmsidecar-runtime ready`` cost 1.1-1.7 s of CPU every 2 s; an
    httpGet on the health-only listener costs the runtime one request (bench/probes.py)."""
    spec = _podman_template() if name == "pod.yaml" else _pod_specs()[name]
    runtime = _runtime_container(spec)
    env = {e["name"]: e.get("value") for e in runtime.get("env", [])}
    assert env.get("VMSIDECAR_HEALTH_LISTEN") == f"0.0.0.0:{HEALTH_PORT}", env  # the kubelet probes the pod IP
    for kind, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        probe = runtime.get(kind)
        assert probe and probe.get("httpGet") == {"path": path, "port": HEALTH_PORT}, (name, kind, probe)
        assert "exec" not in probe
    for c in spec.get("initContainers", []) + spec["containers"]:
        for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
            command = (c.get(kind) or {}).get("exec", {}).get("command", [])
            assert not any("vmsidecar-runtime" in part for part in command), (name, c["name"], kind)


def test_the_pool_pods_probes_are_the_provisioners() -> None:
    """The pool samples cannot set probes: upstream's CRDs have no such field and its provisioner
    renders the runtime container without any (so it costs nothing). If a newer CRD adds one, set
    httpGet probes on the health port in the samples and VMSIDECAR_HEALTH_LISTEN in the runtime's env."""
    for crd in CRDS.glob("*.yaml"):
        text = crd.read_text()
        assert "Probe" not in text and "httpGet" not in text, crd.name


def test_scripts_pod_keeps_what_podman_can_run() -> None:
    """podman 4.3 ignores readinessProbe and runs a livenessProbe as ``curl`` in the container (the
    runtime image has none): scripts/pod drops the liveness probe and publishes the health port on
    the host's loopback; with --host-network the listener itself binds the loopback."""
    spec = _pod_specs()["pod.yaml"]
    runtime = _runtime_container(spec)
    assert "livenessProbe" not in runtime and runtime["readinessProbe"]["httpGet"]["port"] == HEALTH_PORT
    assert {"containerPort": HEALTH_PORT, "hostPort": HEALTH_PORT, "hostIP": "127.0.0.1"} in runtime["ports"]
    rendered = subprocess.run([str(ROOT / "scripts" / "pod"), "render", "--image", "r/x:1", "--host-network",
                               "--health-port", "18081", "--insecure-registry", "127.0.0.1:5000"],
                              cwd=ROOT, capture_output=True, text=True, check=True).stdout
    runtime = _runtime_container(next(d for d in yaml.safe_load_all(rendered) if d["kind"] == "Pod")["spec"])
    env = {e["name"]: e["value"] for e in runtime["env"]}
    assert env == {"VMSIDECAR_HEALTH_LISTEN": "127.0.0.1:18081", "VMSIDECAR_INSECURE_REGISTRIES": "127.0.0.1:5000"}
    assert "ports" not in runtime and runtime["readinessProbe"]["httpGet"]["port"] == 18081


def test_scripts_pod_gives_each_pod_its_own_empty_dirs() -> None:
    """podman 4.3 plays an emptyDir as a named volume called by the volume's name, kept after the pod:
    two pods on one host shared one shared dir (the second runtime found it locked by the first) and
    one state volume. scripts/pod names them after the pod, and removes them at `up` and `down`."""
    def empty_dirs(name: str) -> set[str]:
        rendered = subprocess.run([str(ROOT / "scripts" / "pod"), "render", "--name", name, "--image", "r/x:1"],
                                  cwd=ROOT, capture_output=True, text=True, check=True).stdout
        pod = next(d for d in yaml.safe_load_all(rendered) if d["kind"] == "Pod")["spec"]
        volumes = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
        mounted = {m["name"] for c in pod["containers"] for m in c["volumeMounts"]}
        assert volumes <= mounted
        return volumes

    a, b = empty_dirs("pod-a"), empty_dirs("pod-b")
    assert a and not a & b
    assert all(v.startswith("pod-a-") for v in a)


def _podmonitor() -> dict:
    return next(d for d in _docs(ROOT / "container" / "k8s" / "podmonitor.yaml") if d["kind"] == "PodMonitor")


def test_the_podmonitor_scrapes_what_the_sample_pod_serves() -> None:
    """Issue 22: each endpoint names a port the sample pod declares, on the listener its env turns on,
    and the selector picks that pod (a renamed port or label would silently scrape nothing)."""
    monitor = _podmonitor()
    pod = next(d for d in _docs(ROOT / "container" / "k8s" / "pod-sidecar.yaml") if d["kind"] == "Pod")
    labels = pod["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert set(monitor["spec"]["podTargetLabels"]) <= set(labels)
    listens = {"health": "VMSIDECAR_HEALTH_LISTEN", "metrics": "VMSIDECAR_EXPORTER_METRICS_LISTEN"}
    containers = {c["name"]: c for c in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]}
    scraped = set()
    for endpoint in monitor["spec"]["podMetricsEndpoints"]:
        assert endpoint["path"] == "/metrics"
        owner, port = next((c, p) for c in containers.values() for p in c.get("ports", [])
                           if p["name"] == endpoint["port"])
        env = {e["name"]: e.get("value") for e in owner.get("env", [])}
        assert env[listens[endpoint["port"]]] == f"0.0.0.0:{port['containerPort']}", (owner["name"], env)
        scraped.add(owner["name"])
    assert scraped == {"runtime", "exporter"}


def test_a_bad_podmonitor_is_caught() -> None:
    bad = _podmonitor()
    bad["spec"]["podMetricsEndpoints"] = [{"portNumber": 70000}]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, _crd_schema(bad["kind"], bad["apiVersion"]))
