"""The wire contract between the vmsidecar runtime and its clients (the exporter's drivers, the
CLI, tests): the VM spec, the state model, the error registry, the API's request models and the
API clients (``client.RuntimeClient``, async; ``blocking.BlockingRuntimeClient`` for the CLI,
which must start in well under 0.25 s). It has no hypervisor dependency, so the exporter image carries none."""

from pathlib import Path

#: where the runtime puts its sockets by default (``serve --shared-dir``); here, not in ``blocking``:
#: ``serve`` needs it and no HTTP client
DEFAULT_SHARED_DIR = Path("/shared/vmsidecar")
