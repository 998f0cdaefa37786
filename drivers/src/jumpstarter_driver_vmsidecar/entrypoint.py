"""The all-in-one ``vmsidecar`` image's entrypoint: one ``podman run`` for a developer.

    podman run --rm -it --device /dev/kvm IMAGE shell --image oci://REGISTRY/REPO:TAG [-- CMD …]

Modes (the first argument):

* ``shell``   — ``vmsidecar-shell``: the runtime, the exporter and a ``jmp shell`` in this
  container; ``-- CMD`` runs one command and its exit code is the container's.
* ``serve``   — ``vmsidecar-runtime serve`` alone (what the ``runtime`` image runs).
* ``exporter``— the exporter alone: ``exporter run --exporter-config FILE …`` (one process).
* ``jmp``, ``j``, ``vmsidecar-runtime`` — those commands, as they are.

Each mode replaces this process (exec), so signals reach the command itself.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

USAGE = """usage: IMAGE shell --image REF [--ready-pattern REGEX] [--ready-console ttyS0|hvc0]
                   [--ready-timeout S] [--memory M] [--cpus N] [-- CMD …]
       IMAGE serve [vmsidecar-runtime serve options]
       IMAGE exporter run --exporter-config FILE [--tls-grpc-listener PORT --tls-grpc-insecure]
       IMAGE jmp|j|vmsidecar-runtime …

  podman run --rm -it --device /dev/kvm IMAGE shell --image oci://REGISTRY/REPO:TAG
  podman run --rm --device /dev/kvm IMAGE shell --image oci://… -- j vm power read
"""

BIN = Path(sys.executable).parent
MODULES = {
    "shell": "jumpstarter_driver_vmsidecar.local",
    "exporter": "jumpstarter_driver_vmsidecar.exporter_run",
}
COMMANDS = {"serve": ["vmsidecar-runtime", "serve"], "jmp": ["jmp"], "j": ["j"],
            "vmsidecar-runtime": ["vmsidecar-runtime"]}


def argv_for(args: list[str]) -> list[str] | None:
    """The command a mode runs, or None for an unknown mode."""
    mode, rest = (args[0], args[1:]) if args else ("", [])
    if mode in MODULES:
        return [sys.executable, "-m", MODULES[mode], *rest]
    if mode in COMMANDS:
        first, *more = COMMANDS[mode]
        return [str(BIN / first), *more, *rest]
    return None


def _stdin_is_null() -> bool:
    """``podman run`` without ``-i``: stdin is /dev/null (or closed), so a shell would end at once."""
    try:
        return os.path.samestat(os.fstat(0), os.stat(os.devnull))
    except OSError:
        return True


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] in (["-h"], ["--help"], ["help"]):
        print(USAGE + "\n" + (__doc__ or ""))
        return 0
    command = argv_for(args)
    if command is None:
        print(f"error: {'unknown mode ' + repr(args[0]) if args else 'no mode given'}\n{USAGE}", file=sys.stderr)
        return 2
    if args[0] == "shell" and "--" not in args and _stdin_is_null():
        print("vmsidecar: no terminal for an interactive shell: add -it to `podman run`, or run one command "
              "with `-- CMD …`", file=sys.stderr)
        return 2
    os.execv(command[0], command)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
