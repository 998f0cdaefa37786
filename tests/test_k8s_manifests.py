"""Every manifest we ship validates: Kubernetes objects against the Kubernetes schemas
(kubernetes-validate), the pool samples against upstream's real ExporterSet/VirtualTargetClass CRDs."""

from __future__ import annotations

import re
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


# ---- the security review of the pod templates (2026-11-29) ------------------------------------------

def _sample_pod() -> dict:
    return next(d for d in _docs(ROOT / "container" / "k8s" / "pod-sidecar.yaml") if d["kind"] == "Pod")


def test_the_sample_pod_restarts_a_failed_exporter_beside_its_running_runtime() -> None:
    """With ``restartPolicy: Never`` a crashed or OOM-killed exporter ended the pod, and the kubelet
    stopped the runtime (a sidecar) and the guest with it. OnFailure restarts only the exporter; an
    exporter that exits 0 (ExitAndReplace after its lease, or stopped by a signal) still completes the pod."""
    spec = _sample_pod()["spec"]
    assert spec["restartPolicy"] == "OnFailure"
    runtime = _runtime_container(spec)
    assert runtime in spec["initContainers"] and runtime["restartPolicy"] == "Always"  # a native sidecar
    assert [c["name"] for c in spec["containers"]] == ["exporter"]


def _networkpolicy() -> dict:
    path = ROOT / "container" / "k8s" / "networkpolicy.yaml"
    return next(d for d in _docs(path) if d["kind"] == "NetworkPolicy")


def _pod_specs_with_metadata() -> dict[str, dict]:
    rendered = subprocess.run([str(ROOT / "scripts" / "pod"), "render", "--image", "r/x:1"],
                              cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return {"pod.yaml": next(d for d in yaml.safe_load_all(rendered) if d["kind"] == "Pod")}


def _pool_pod_labels() -> dict[str, dict[str, str]]:
    """The labels of every pod the samples make: the Pods we ship, and the ExporterSets' pods, which
    upstream's qemu provisioner labels with the template's labels (``RenderPod``: maps.Clone of
    ``spec.template.metadata.labels``)."""
    labels = {"pod-sidecar.yaml": _sample_pod()["metadata"].get("labels", {}),
              "pod.yaml": _pod_specs_with_metadata()["pod.yaml"]["metadata"]["labels"]}
    for path in MANIFESTS:
        for doc in _docs(path):
            if doc["kind"] == "ExporterSet":
                labels[path.name] = doc["spec"]["template"].get("metadata", {}).get("labels", {})
    assert len(labels) == 5, labels
    return labels


def test_the_networkpolicy_selects_every_pool_pod() -> None:
    selector = _networkpolicy()["spec"]["podSelector"]
    assert set(selector) == {"matchLabels"} and selector["matchLabels"], selector  # never {}: no other pods
    for name, labels in _pool_pod_labels().items():
        assert selector["matchLabels"].items() <= labels.items(), f"{name}'s pods ({labels}) are not selected"


def test_the_networkpolicy_denies_by_default_and_admits_only_the_scrapes() -> None:
    """Both directions are denied but for the rules (policyTypes both); ingress: only the two GET-only
    listeners the sample pod declares, from a namespace chosen by its label, never from anywhere."""
    spec = _networkpolicy()["spec"]
    assert sorted(spec["policyTypes"]) == ["Egress", "Ingress"]
    pod = _sample_pod()["spec"]
    declared = {p["containerPort"] for c in pod["initContainers"] + pod["containers"] for p in c.get("ports", [])}
    assert declared == {8081, 8082}
    admitted = set()
    for rule in spec["ingress"]:
        assert rule.get("from") and rule.get("ports"), rule  # a rule without either admits everything
        for peer in rule["from"]:
            assert set(peer) == {"namespaceSelector"} and peer["namespaceSelector"]["matchLabels"], peer
        admitted |= {(p["protocol"], p["port"]) for p in rule["ports"]}
    assert admitted == {("TCP", 8081), ("TCP", 8082)}


def test_the_networkpolicy_keeps_the_guest_from_the_metadata_service_and_the_cluster() -> None:
    """The guest's connections are the pod's (slirp): every egress rule names its peers and ports,
    DNS goes to kube-dns only, and an ipBlock never covers the metadata address, nor the pod and
    service CIDRs it excepts."""
    import ipaddress

    egress = _networkpolicy()["spec"]["egress"]
    metadata = ipaddress.ip_address("169.254.169.254")
    dns = []
    for rule in egress:
        assert rule.get("to") and rule.get("ports"), rule  # a rule without either allows all of it
        for peer in rule["to"]:
            if block := peer.get("ipBlock"):
                cidr = ipaddress.ip_network(block["cidr"])
                excepted = [ipaddress.ip_network(e) for e in block.get("except", [])]
                if metadata in cidr:
                    assert any(metadata in e for e in excepted), f"{block} reaches the metadata service"
                    assert "169.254.169.254/32" in block["except"]
                if cidr.prefixlen == 0:  # as wide as the internet: the cluster's own ranges are excepted
                    assert len([e for e in excepted if e.is_private and metadata not in e]) >= 2, block
            else:
                assert peer.get("namespaceSelector", {}).get("matchLabels"), peer  # a namespace, named
                assert peer.get("podSelector"), peer  # and pods in it: never a whole namespace
        if any(p["port"] == 53 for p in rule["ports"]):
            dns.append(rule)
    assert len(dns) == 1
    assert {(p["protocol"], p["port"]) for p in dns[0]["ports"]} == {("UDP", 53), ("TCP", 53)}
    kube_system = {"kubernetes.io/metadata.name": "kube-system"}
    assert dns[0]["to"] == [{"namespaceSelector": {"matchLabels": kube_system},
                             "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}]


#: the runtime's memory rule (docs/containers.md, "Resources"), MiB
RUNTIME_ITSELF, TCG_CACHE, QEMU_IMG_CHECK = 150, 64, 768


#: a parked QEMU's memory (``standby: parked``: RSS 40 MB, PSS 28 MB measured), rounded up
PARKED_QEMU = 64


def _runtime_memory_floor(memory_mib: int, standby: bool | str) -> int:
    """150 MiB + max(a capturing boot: 2 x the guest + TCG's cache, a flash's qemu-img check with the
    guest off) + a standby spare (the guest's RAM at worst + its own TCG cache) or a parked QEMU."""
    floor = RUNTIME_ITSELF + max(2 * memory_mib + TCG_CACHE, QEMU_IMG_CHECK)
    if standby == "parked":
        return floor + PARKED_QEMU
    return floor + (memory_mib + TCG_CACHE if standby else 0)


def test_the_rule_counts_the_capture_the_flash_and_the_spare() -> None:
    assert _runtime_memory_floor(512, False) == 1238 and _runtime_memory_floor(512, True) == 1814
    assert _runtime_memory_floor(512, "parked") == 1302
    assert _runtime_memory_floor(128, False) == 150 + 768  # a small guest: the flash's check dominates


def _mib(quantity: str) -> int:
    return parse_size(quantity) >> 20


def _vm_specs(drivers: dict[str, dict]) -> list:
    return [load_spec(d["config"]["spec"]) for d in drivers.values() if d["type"].endswith(".VirtualMachine")]


def test_the_runtimes_memory_limit_fits_its_guests() -> None:
    """Each sample's limit is at least the rule's floor for its driver spec (memory, standby): a
    capturing boot or a spare over it is OOM-killed, and the guest with it."""
    classes = {d["metadata"]["name"]: d for d in _docs(ROOT / "container" / "k8s" / "virtualtargetclass.yaml")
               if d["kind"] == "VirtualTargetClass"}
    checked = []
    for path in MANIFESTS:
        for doc in _docs(path):
            if doc["kind"] == "ExporterSet":
                resources = classes[doc["spec"]["virtualTargetClassName"]]["spec"]["scheduling"]["resources"]
                specs = _vm_specs({d["name"]: d for d in doc["spec"]["template"]["spec"]["drivers"]})
                checked.append((path.name, resources, specs))
    sample = _docs(ROOT / "container" / "k8s" / "pod-sidecar.yaml")
    secret = next(d for d in sample if d["kind"] == "Secret")
    pod = _sample_pod()["spec"]
    assert secret["metadata"]["name"] in {v.get("secret", {}).get("secretName") for v in pod["volumes"]}
    config = yaml.safe_load(secret["stringData"]["config.yaml"])
    checked.append(("pod-sidecar.yaml", _runtime_container(pod)["resources"], _vm_specs(config["export"])))
    assert len(checked) == 4
    for name, resources, specs in checked:
        assert len(specs) == 1, name
        floor = _runtime_memory_floor(specs[0].memory, specs[0].standby)
        limit = _mib(resources["limits"]["memory"])
        assert limit >= floor, f"{name}: the runtime's memory limit {limit} MiB < the rule's {floor} MiB"
        assert resources["requests"]["memory"] == resources["limits"]["memory"], name  # guest RAM is reserved
        assert "cpu" in resources["requests"] and "cpu" not in resources["limits"], name  # no CFS throttling


def test_the_sample_pods_containers_have_requests_and_limits() -> None:
    """Both containers request CPU, memory and ephemeral storage and have memory and ephemeral-storage
    limits; the exporter's memory limit holds its upload streams (2 x 128 MiB) over its ~85 MB."""
    spec = _sample_pod()["spec"]
    for c in spec["initContainers"] + spec["containers"]:
        requests, limits = c["resources"]["requests"], c["resources"]["limits"]
        assert {"cpu", "memory", "ephemeral-storage"} <= set(requests), c["name"]
        assert {"memory", "ephemeral-storage"} <= set(limits) and "cpu" not in limits, c["name"]
        for key in ("memory", "ephemeral-storage"):
            assert parse_size(requests[key]) <= parse_size(limits[key]), (c["name"], key)
    exporter = spec["containers"][0]
    assert _mib(exporter["resources"]["limits"]["memory"]) >= 96 + 2 * 128


#: what a container's logs may hold on the node (the kubelet's default rotation: 5 files of 10Mi) and more
LOG_ALLOWANCE_MIB = 64


def test_the_sample_pods_ephemeral_storage_covers_its_empty_dirs() -> None:
    """A disk emptyDir counts against the pod's ephemeral-storage limit (the sum of its containers'):
    below the sizeLimits, the kubelet would evict the pod before an emptyDir reached its own bound.
    Each container's limit covers the emptyDirs charged to it (the shared one to the runtime) and its logs."""
    spec = _sample_pod()["spec"]
    sizes = {v["name"]: _mib(v["emptyDir"]["sizeLimit"]) for v in spec["volumes"]
             if "emptyDir" in v and v["emptyDir"].get("medium") != "Memory"}
    charged: set[str] = set()
    total = 0
    for c in spec["initContainers"] + spec["containers"]:  # the runtime first: it makes the shared dir
        mine = {m["name"] for m in c["volumeMounts"] if m["name"] in sizes} - charged
        charged |= mine
        limit = _mib(c["resources"]["limits"]["ephemeral-storage"])
        need = sum(sizes[v] for v in mine) + LOG_ALLOWANCE_MIB
        assert limit >= need, f"{c['name']}: ephemeral-storage {limit} MiB < its emptyDirs and logs' {need}"
        total += limit
    assert charged == set(sizes)
    assert total >= sum(sizes.values()) + LOG_ALLOWANCE_MIB * len(spec["initContainers"] + spec["containers"])


def test_the_pool_classes_bound_the_runtimes_writable_layer() -> None:
    """Upstream's pool pods mount nothing but /shared: the cache (the runtime's default budget) and the
    state are on the runtime's writable layer, bounded by the class's ephemeral-storage limit."""
    for doc in _docs(ROOT / "container" / "k8s" / "virtualtargetclass.yaml"):
        resources = doc["spec"]["scheduling"]["resources"]
        limit = parse_size(resources["limits"]["ephemeral-storage"])
        assert parse_size(resources["requests"]["ephemeral-storage"]) <= limit
        # the budget with ~15% for a pull and a capture (as for pod-sidecar.yaml's cache volume), and
        # 4 GiB for the state: the lease's overlay and a flashed disk
        assert limit >= DEFAULT_BUDGET / 0.85 + (4 << 30), f"{doc['metadata']['name']}: no room for the state"


def test_every_image_of_the_samples_says_to_pin_by_digest() -> None:
    """A tag can be moved to other bytes by whoever can push to it; nodes pulling it at different
    times then run different code next to lease holders. Every image reference in the samples is
    pinned (@sha256:) or says, on its line or in the comment just above it, that a pool pins it."""
    for path in MANIFESTS:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if not re.search(r"\bimage: *[\w.-]+\.[\w.-]+(:\d+)?/", line.split("#")[0]):
                continue
            above = [text for text in lines[max(0, i - 2):i] if text.lstrip().startswith("#")]
            pinned = "@sha256:" in line or any("sha256" in text for text in [line, *above])
            assert pinned, f"{path.name}:{i + 1}: {line.strip()}"


def _stub_podman(tmp_path: Path, existing_networks: dict[str, str] | None = None
                 ) -> tuple[dict[str, str], Path]:
    """A `podman` that logs its arguments and answers as an empty host (no pod; the networks given, name
    -> isolate option), for running scripts/pod without podman."""
    bin_dir, log, nets = tmp_path / "bin", tmp_path / "podman.log", tmp_path / "networks"
    bin_dir.mkdir(parents=True)
    nets.mkdir()
    for name, isolate in (existing_networks or {}).items():
        (nets / name).write_text(isolate)
    stub = bin_dir / "podman"
    stub.write_text(f"""#!/bin/sh
echo "$*" >> {log}
case "$1 $2" in
  "pod exists") exit 1;;
  "network exists") [ -e "{nets}/$3" ];;
  "network create") for last; do :; done; echo true > "{nets}/$last";;
  "network inspect") for last; do :; done; cat "{nets}/$last";;
  "network rm") rm -f "{nets}/$3";;
  "kube play") cat > /dev/null;;
esac
""")
    stub.chmod(0o755)
    import os
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}, log


def _calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_scripts_pod_plays_each_pod_on_an_isolated_network_of_its_own(tmp_path: Path) -> None:
    """On podman's default kube network one pod's guest (root, the lease holder: slirp makes its
    connections the pod's) reached another pod's exporter, insecure gRPC on 0.0.0.0:19090, and drove
    its VM. scripts/pod creates NAME-net with isolate=true (netavark blocks traffic between such
    networks), plays the pod on it, and removes it at down; checked with podman for real in
    docs/containers.md. --host-network pods use the host's network instead."""
    env, log = _stub_podman(tmp_path)
    pod = ROOT / "scripts" / "pod"

    def up(name: str, *extra: str) -> list[str]:
        before = len(_calls(log))
        subprocess.run([str(pod), "up", "--name", name, "--image", "r/x:1", *extra], cwd=ROOT, env=env,
                       capture_output=True, text=True, check=True)
        return _calls(log)[before:]

    a, b = up("pod-a"), up("pod-b")
    for name, calls in (("pod-a", a), ("pod-b", b)):
        assert f"network create --opt isolate=true {name}-net" in calls, calls
        plays = [c for c in calls if c.startswith("kube play")]
        assert plays == [f"kube play --quiet --network {name}-net -"], plays
        assert calls.index(f"network create --opt isolate=true {name}-net") < calls.index(plays[0])
    before = len(_calls(log))
    subprocess.run([str(pod), "down", "--name", "pod-a"], cwd=ROOT, env=env, capture_output=True, check=True)
    down = _calls(log)[before:]
    assert "network rm pod-a-net" in down  # never -f: that would remove containers still on it
    assert down.index("network rm pod-a-net") > down.index("pod rm -f -t 30 pod-a")
    networks = tmp_path / "networks"
    assert not (networks / "pod-a-net").exists() and (networks / "pod-b-net").exists()
    host = up("pod-h", "--host-network")
    assert not any(c.startswith("network create") for c in host)
    assert [c for c in host if c.startswith("kube play")] == ["kube play --quiet -"]


def test_scripts_pod_refuses_a_leftover_network_that_is_not_isolated(tmp_path: Path) -> None:
    env, log = _stub_podman(tmp_path, {"pod-c-net": "false"})
    result = subprocess.run([str(ROOT / "scripts" / "pod"), "up", "--name", "pod-c", "--image", "r/x:1"],
                            cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 1 and "not isolated" in result.stderr, result.stderr
    assert not any(c.startswith("kube play") for c in _calls(log))
    env, log = _stub_podman(tmp_path / "again", {"pod-c-net": "true"})  # an isolated leftover is reused
    subprocess.run([str(ROOT / "scripts" / "pod"), "up", "--name", "pod-c", "--image", "r/x:1"],
                   cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert "kube play --quiet --network pod-c-net -" in _calls(log)


def _containerfile_stages() -> list[tuple[str, str, list[str]]]:
    """(name, parent, RUN instructions with their continuation lines joined) of each stage."""
    stages: list[tuple[str, str, list[str]]] = []
    text = (ROOT / "Containerfile").read_text().replace("\\\n", " ")
    for line in text.splitlines():
        if m := re.match(r"FROM\s+(\S+)\s+AS\s+(\S+)", line, re.I):
            stages.append((m.group(2), m.group(1), []))
        elif line.startswith("RUN ") and stages:
            stages[-1][2].append(line)
    return stages


STRIP_SETID = re.compile(r"find / -xdev -perm /6000 -type f -exec chmod a-s \{\} \+")


def test_the_images_carry_no_setuid_or_setgid_file() -> None:
    """su, mount, passwd, chsh, newgrp, unix_chkpwd … were in every image, and upstream's pool pods
    cannot set allowPrivilegeEscalation: false. The base stage strips the bits of the whole root
    filesystem, so every stage derived from it starts without; a stage that installs packages after
    it strips again in the RUN that installs them."""
    stages = _containerfile_stages()
    names = {name: parent for name, parent, _ in stages}
    assert stages[0][0] == "base"
    base_runs = stages[0][2]
    assert any(STRIP_SETID.search(run) for run in base_runs), base_runs
    assert STRIP_SETID.search(base_runs[-1]), "the strip is not base's last RUN"

    def ancestry(name: str) -> list[str]:
        chain = [name]
        while chain[-1] in names:
            chain.append(names[chain[-1]])
        return chain

    for name, _, runs in stages:
        chain = ancestry(name)
        assert chain[-2:] == ["base", stages[0][1]], f"stage {name} does not derive from base: {chain}"
        if name == "base" or "builder" in chain:  # base: above; builders: only /opt/vmsidecar is copied out
            continue
        for run in runs:
            if "apt-get install" in run:
                assert STRIP_SETID.search(run.split("apt-get install", 1)[1]), f"{name}: {run[:80]} …"


@pytest.mark.parametrize(("option", "value", "words"), [
    ("--recycle", "Exit", "--recycle Exit: use ExitAndReplace or InPlaceReuse"),
    ("--port", "19o90", "--port 19o90: use a TCP port, 1-65535"),
    ("--health-port", "70000", "--health-port 70000: use a TCP port, 1-65535"),
    ("--name", "my pod", "--name 'my pod': use letters, digits, '_', '.' and '-'"),
    ("--memory", "1 G", "--memory '1 G': write it like 512M or 2G"),
    ("--image", "r/x:1\n  privileged: true", "--image: a reference has no whitespace or quotes"),
])
def test_pod_options_that_would_break_the_rendered_pod_are_named(option: str, value: str, words: str) -> None:
    """scripts/pod puts these into the pod's YAML and podman's names: a bad one was passed on (a
    `--recycle Exit` pod came up and its exporter failed; an `--image` with a newline added its own
    lines to the YAML)."""
    args = ["--image", "127.0.0.1:5000/vm/tiny:1"] if option != "--image" else []
    result = subprocess.run([str(ROOT / "scripts" / "pod"), "render", *args, option, value], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 2 and result.stdout == "", (result.stdout, result.stderr)
    assert f"scripts/pod: {words}" in result.stderr, result.stderr
