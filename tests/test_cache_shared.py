"""One image cache shared by the runtimes of several pods (a node's cache volume): what one runtime
does to the cache's temporary files never ends another's download, whichever PID namespace each
runs in; what a runtime that died left is cleaned by the next pull."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from vmsidecar_runtime.oci.cache import DiskCache

#: a writer: a runtime's pull, its temporary file open, until told to end (stdin closed)
WRITER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from vmsidecar_runtime.oci.cache import DiskCache
    tmp = DiskCache(Path(sys.argv[1])).tmp_path()
    tmp.write_bytes(b"half a download")
    print(tmp, flush=True)
    sys.stdin.read()
""")
#: another runtime's pull beginning: it cleans what it takes for orphans
CLEANER = "import sys; from pathlib import Path; from vmsidecar_runtime.oci.cache import DiskCache; " \
          "DiskCache(Path(sys.argv[1])).clean_stale()"


def _in_another_pid_namespace() -> list[str]:
    """The prefix that runs a command in a new PID namespace, as another pod's runtime is (as root,
    or as a user where user namespaces are allowed)."""
    if os.geteuid() == 0:
        return ["unshare", "--pid", "--fork"]
    return ["unshare", "--user", "--map-root-user", "--pid", "--fork"]


def test_a_runtime_in_another_pod_never_removes_a_live_runtimes_download(tmp_path: Path) -> None:
    """The cleaner of a pull took a temporary file for an orphan when the PID in its name was not
    alive in the cleaner's own PID namespace: in another pod, the download of a live runtime."""
    cache = tmp_path / "cache"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(cache)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout is not None
        part = Path(writer.stdout.readline().strip())
        assert part.exists()
        cleaner = subprocess.run([*_in_another_pid_namespace(), sys.executable, "-c", CLEANER, str(cache)],
                                 capture_output=True, text=True, timeout=60)
        assert cleaner.returncode == 0, f"the other pod's runtime could not run: {cleaner.stderr.strip()}"
        assert part.exists(), "a runtime in another PID namespace removed a live runtime's download"
        DiskCache(cache).clean_stale()  # and one in the same namespace
        assert part.exists(), "a runtime removed a live runtime's download"
    finally:
        writer.communicate("")
    assert part.exists()  # (a writer that ends leaves its file: the next pull cleans it)
    subprocess.run([*_in_another_pid_namespace(), sys.executable, "-c", CLEANER, str(cache)], check=True,
                   timeout=60)
    assert not part.exists(), "the file of a runtime that ended was not cleaned"
    assert not list((cache / "locks").glob("tmp-owner.*")), "the ended runtime's lock file was left"
    # a runtime that ended with no temporary file left (every download installed) leaves its lock
    # file: the next pull removes it too, or they pile up, one per process, on the shared volume
    tidy = subprocess.run([sys.executable, "-c", WRITER.replace('tmp.write_bytes(b"half a download")', "pass"),
                           str(cache)], input="", capture_output=True, text=True, timeout=60, check=True)
    assert not Path(tidy.stdout.strip()).exists() and list((cache / "locks").glob("tmp-owner.*"))
    DiskCache(cache).clean_stale()
    assert not list((cache / "locks").glob("tmp-owner.*")), "an ended runtime's lock file was left"
