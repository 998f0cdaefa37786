"""The Grafana dashboard (container/grafana/vmsidecar-dashboard.json) queries only what is exported:
every metric name in every PromQL query is served by a live runtime's ``/metrics`` (health listener)
or a live exporter's, and every label it groups or filters by is one of theirs or a label the
PodMonitor's targets carry (issue 22)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from fixtures.health import health_runtime, http_get
from fixtures.jmp import exporter_config, jmp_env
from fixtures.ports import free_port
from fixtures.waiting import wait_until_async

ROOT = Path(__file__).parents[1]
DASHBOARD = ROOT / "container" / "grafana" / "vmsidecar-dashboard.json"
#: labels Prometheus adds to every series of a PodMonitor's targets (container/k8s/podmonitor.yaml:
#: the operator's namespace/pod/container/endpoint, the scrape's job/instance, podTargetLabels' vm)
TARGET_LABELS = {"namespace", "pod", "container", "endpoint", "job", "instance", "vm"}

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset",
             "bool", "inf", "nan"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHERS = re.compile(r"\{([^}]*)\}")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_RANGE = re.compile(r"\[[^\]]*\]")
_IDENT = re.compile(r"(?<![\w$.])([A-Za-z_:][\w:]*)\b(\s*\()?")


def queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target (rows' nested panels too) and every query variable."""
    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for p in items:
            yield p
            yield from panels(p.get("panels", []))

    for panel in panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r} {target['refId']}", target["expr"]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            yield f"variable {var['name']}", re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", query)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (not its functions, keywords or labels)."""
    text = _STRING.sub('""', expr)
    text = _MATCHERS.sub("{}", text)
    text = _GROUPING.sub("", text)
    text = _RANGE.sub("", text)
    return {m.group(1) for m in _IDENT.finditer(text) if not m.group(2) and m.group(1).lower() not in _KEYWORDS}


def label_names(expr: str) -> set[str]:
    """The label names an expression filters (``{name="…"}``) or groups by (``by (a, b)``)."""
    text = _STRING.sub('""', expr)
    names = {n for body in _MATCHERS.findall(text) for n in re.findall(r"([A-Za-z_]\w*)\s*[!=]~?", body)}
    names |= {n.strip() for body in _GROUPING.findall(text) for n in body.split(",") if n.strip()}
    return names


def exported(body: bytes) -> tuple[set[str], set[str]]:
    """Sample names (``_bucket``, ``_count``… included) and label names of an exposition."""
    names, labels = set(), set()
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            names.add(sample.name)
            labels |= set(sample.labels)
    return names, labels


def test_the_query_parser_finds_metrics_and_labels() -> None:
    expr = ('histogram_quantile(0.95, sum by (le, kind) (rate(vmsidecar_boot_to_ready_seconds_bucket'
            '{namespace=~"$namespace", pod=~"a|b"}[$__rate_interval]))) / on (pod) group_left '
            'count(up{job="x"}) > 0 and vmsidecar_generation offset 5m')
    assert metric_names(expr) == {"vmsidecar_boot_to_ready_seconds_bucket", "up", "vmsidecar_generation"}
    assert label_names(expr) == {"le", "kind", "namespace", "pod", "job"}


def test_the_dashboard_has_the_issues_panels() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [e for _, e in queries(dashboard)]
    assert all(metric_names(e) for e in exprs)
    wanted = {
        "pool readiness": r'vmsidecar_phase\{phase="Ready"',
        "recycle p50": r"histogram_quantile\(0\.5, .*vmsidecar_recycle_to_ready_seconds_bucket",
        "recycle p95": r"histogram_quantile\(0\.95, .*vmsidecar_recycle_to_ready_seconds_bucket",
        "snapshot hit ratio": r'vmsidecar_snapshot_lookups_total\{result="hit".*/.*vmsidecar_snapshot_lookups_total',
        "errors by code": r"sum by \(code\) \(.*vmsidecar_errors_total",
        "RSS per instance": r"by \(namespace, pod\) \(vmsidecar_qemu_resident_memory_bytes",
    }
    missing = [what for what, pattern in wanted.items() if not any(re.search(pattern, e) for e in exprs)]
    assert not missing, missing
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


async def test_every_query_names_only_what_a_live_runtime_and_exporter_export(
    start_runtime: Any, tiny_image: Any, tmp_path: Path
) -> None:
    """Names are checked against the exposition itself (not a list in a doc): a metric renamed in
    the runtime and not in the dashboard fails here. No guest needs to boot: every series exists
    from the start, at zero (the runtime's metrics.py, the exporter's metrics.py)."""
    rt, health_port = await health_runtime(start_runtime, None)
    status, _, body = http_get(health_port, "/metrics")
    assert status == 200, f"the runtime serves no /metrics on its health listener ({status})"
    names, labels = exported(body)

    metrics_port = free_port()
    cfg = exporter_config(tmp_path / "exporter.yaml", {"socket": str(rt.socket), "recycle": "InPlaceReuse"})
    with open(tmp_path / "exporter.log", "wb") as log:
        exporter = subprocess.Popen(
            [sys.executable, "-m", "jumpstarter_driver_vmsidecar.exporter_run", "run", "--exporter-config", str(cfg),
             "--tls-grpc-listener", f"127.0.0.1:{free_port()}", "--tls-grpc-insecure",
             "--metrics-listen", f"127.0.0.1:{metrics_port}"],
            env=jmp_env(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        def scraped() -> bytes | None:
            try:
                status, _, body = http_get(metrics_port, "/metrics")
            except OSError:
                return None
            # the listener starts before the exporter config is loaded; the drivers' call series with it
            return body if status == 200 and b"vmsidecar_exporter_driver_calls_total{" in body else None

        body = await wait_until_async(scraped, 60, "the exporter's /metrics with its drivers loaded",
                                      detail=lambda: (tmp_path / "exporter.log").read_text(errors="replace"))
    finally:
        exporter.terminate()
        exporter.wait(60)
    more_names, more_labels = exported(body)
    names |= more_names
    labels |= more_labels | TARGET_LABELS

    dashboard = json.loads(DASHBOARD.read_text())
    unknown = {where: sorted(metric_names(e) - names) for where, e in queries(dashboard) if metric_names(e) - names}
    assert not unknown, f"queries name metrics nobody exports: {unknown}"
    unknown = {where: sorted(label_names(e) - labels) for where, e in queries(dashboard) if label_names(e) - labels}
    assert not unknown, f"queries use labels no series has: {unknown}"
