"""``python -I -S landlock_exec.py FD PROGRAM ARG...``: enter the Landlock ruleset ``FD`` and exec.

The step between setpriv and QEMU (``confinement.py``): the runtime builds the ruleset (with
landlockpy) and hands its descriptor down; this program only enforces it on itself, then execs the
program, which inherits the domain. It runs with ``-S`` and imports nothing of the package, so it
starts in ~8 ms: landlockpy's ``restrict`` is a method of a ruleset built in this process, so the
one syscall is made here through ctypes. The caller sets no_new_privs (``setpriv --no-new-privs``),
which an unprivileged ``landlock_restrict_self`` needs.
"""

import ctypes
import os
import sys

#: ``landlock_restrict_self``: the same number on every architecture (the unified syscall table)
SYS_LANDLOCK_RESTRICT_SELF = 446


def main() -> None:
    ruleset, program = int(sys.argv[1]), sys.argv[2:]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0) != 0:
        # exit before the program runs: never unconfined once the runtime chose to confine it
        sys.stderr.write(f"vmsidecar: cannot enter the Landlock domain: {os.strerror(ctypes.get_errno())}\n")
        sys.exit(126)
    os.close(ruleset)
    os.execvp(program[0], program)  # (setpriv searched PATH for this program; so does this)


if __name__ == "__main__":
    main()
