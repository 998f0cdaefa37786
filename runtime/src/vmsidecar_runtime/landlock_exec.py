"""``python -I -S landlock_exec.py FD PROGRAM ARG...``: enter the Landlock ruleset ``FD`` and exec.

The step before QEMU or qemu-img (``confinement.py``, ``procs.confined_argv``): the runtime builds
the ruleset (with landlockpy) and hands its descriptor down; this program only enforces it on
itself, then execs the program, which inherits the domain. It runs with ``-S`` and imports nothing
of the package, so it starts in ~8 ms: landlockpy's ``restrict`` is a method of a ruleset built in
this process, so the syscall is made here through ctypes, after no_new_privs (which an unprivileged process needs to
enter a domain; a setuid program it execs gains nothing).
"""

import ctypes
import os
import sys

#: ``landlock_restrict_self``: the same number on every architecture (the unified syscall table)
SYS_LANDLOCK_RESTRICT_SELF = 446
PR_SET_NO_NEW_PRIVS = 38


def main() -> None:
    ruleset, program = int(sys.argv[1]), sys.argv[2:]
    libc = ctypes.CDLL(None, use_errno=True)
    # no_new_privs first: an unprivileged process may enter a domain only with it
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0) != 0:
        # exit before the program runs: never unconfined once the runtime chose to confine it
        sys.stderr.write(f"vmsidecar: cannot enter the Landlock domain: {os.strerror(ctypes.get_errno())}\n")
        sys.exit(126)
    os.close(ruleset)
    os.execvp(program[0], program)  # (setpriv searched PATH for this program; so does this)


if __name__ == "__main__":
    main()
