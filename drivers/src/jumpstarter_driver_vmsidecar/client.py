"""Client side: the standard FlasherClient plus ``oci://`` references and clear local-file errors (flash and dump)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from jumpstarter.client.flasher import FlasherClient, PathBuf
from jumpstarter.streams.encoding import Compression


class VmStorageClient(FlasherClient):
    """``flash(path | URL | "oci://REF")`` and ``dump(path)``; everything else as FlasherClient."""

    def _flash_single(self, image: PathBuf, *, target: str | None, compression: Compression | None) -> Any:
        text = str(image)
        if text.startswith("oci://"):
            result: dict[str, Any] = {}
            for line in self.streamingcall("flash_oci", text, target):
                if line.get("type") == "progress":
                    total = line.get("total")
                    size = f"{int(line['done']) / 1e6:.1f}" + (f"/{float(total) / 1e6:.1f}" if total else "")
                    print(f"pulled {size} MB", file=sys.stderr)
                else:
                    result = line
            return result
        if not text.startswith(("http://", "https://")) and not Path(text).is_file():
            raise FileNotFoundError(f"{text} does not exist or is not a file; give the path of a qcow2/raw image, "
                                    "an http(s):// URL or oci://REGISTRY/REPO:TAG")
        return super()._flash_single(image, target=target, compression=compression)

    def dump(self, path: PathBuf, *, target: str | None = None, compression: Compression | None = None) -> Any:
        text = str(path)
        if not text.startswith(("http://", "https://")):
            # checked before the call: upstream's local writer fails on a directory only once the
            # disk streams, and the client then waits on the driver's stream until it is killed
            from vmsidecar_contract.blocking import dump_target_problem  # here: only a dump needs it

            if (problem := dump_target_problem(Path(text))) is not None:
                raise OSError(f"cannot dump the disk into {text}: {problem}")
        return super().dump(path, target=target, compression=compression)
