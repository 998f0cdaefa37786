"""Run the test controller standalone, for debugging: ``PYTHONPATH=tests uv run python -m jmpctl``.

Writes a MockPower exporter config and a client config, prints the commands to use them,
then prints every status report until Ctrl-C. ``--lease EXPORTER`` also creates a lease
for client ``c`` once the exporter is AVAILABLE (use it with ``jmp shell --lease NAME``).
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

from .harness import BIN, JmpController


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m jmpctl")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--dir", type=Path, default=None, help="work directory (default: a new temp dir)")
    ap.add_argument("--lease", metavar="EXPORTER", help="create a lease on EXPORTER for client 'c'")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    workdir = args.dir or Path(tempfile.mkdtemp(prefix="jmpctl-"))
    with JmpController(workdir, port=args.port) as ctl:
        exporter = ctl.exporter_config({"power": {"type": "jumpstarter_driver_power.driver.MockPower"}})
        client = ctl.client_config("c")
        print(f"controller + router on {ctl.endpoint} (work dir {workdir})")
        print(f"  exporter: {BIN}/jmp run --exporter-config {exporter}")
        print(f"  client:   {BIN}/jmp shell --client-config {client} -n vm -- j power on")
        print("  (set XDG_CONFIG_HOME and PYTHONPATH as JmpController.env() does if needed)")
        seen: dict[str, int] = {}
        leased = False
        try:
            while True:
                for name, x in list(ctl.registry.exporters.items()):
                    for t, status, msg in x.status_log[seen.get(name, 0):]:
                        print(f"{t:12.3f} {name}: {status} {msg}")
                    seen[name] = len(x.status_log)
                    if args.lease == name and not leased and x.status == "AVAILABLE" and x.online:
                        print(f"lease {ctl.create_lease(name)} for client c on {name}")
                        leased = True
                time.sleep(0.5)  # an interactive monitor: prints what changed twice a second until Ctrl-C
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
