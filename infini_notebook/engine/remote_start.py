"""How an engine starts on a host other than the kernel's (ssh, mpiexec, Slurm): with an
ipyparallel profile folder of its own.

    python -m infini_notebook.engine.remote_start make|check [ipengine arguments]

ipengine runs any ipengine_config.py it finds in its profile folder, so that folder must be
this user's alone, and new:

- ``make`` (mpiexec, Slurm): a new folder on this host (``tempfile.mkdtemp``: mode 0700, a
  random name made at each start, so a removed one is never used again) holds the profile.
  The session's IPP_PROFILE_DIR (the kernel's folder, on the kernel's host) stays in the
  environment as the mark of the session's processes (launch/watchdog.py), unused here.
- ``check`` (ssh): the kernel made this host's folder over ssh (launch/ssh.py), and
  ipyparallel put the profile, the connection file and the engine's output in it. Refused
  unless it is a folder (not a link) of this user's with mode 0700.

The folder's path is left in INFINI_ENGINE_FOLDER, and bootstrap removes it once the rank is
set up (``remove_own_folder``: the engine reads nothing there after registering), so a kernel
that dies later leaves neither a connection file nor output behind. An engine that ends
before that removes it itself, unless it failed on ssh: the kernel reads the engine's output
there to say why, then removes it.

Importing it stays cheap and torch-free (see ``engine``).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

from .own_files import folder_problem, untrusted_ancestor

FOLDER_ENV = "INFINI_ENGINE_FOLDER"


class Refused(Exception):
    """The profile folder is not this engine's own."""


def prepare(mode: str, environ) -> tuple[str, list[str]]:
    """(this engine's folder, ipengine arguments to add) for ``mode``; Refused when the
    folder in IPP_PROFILE_DIR is not this user's own (``check``)."""
    from ..launch.watchdog import FOLDER_PREFIX

    if mode == "make":
        refuse_shared_tmp(tempfile.gettempdir())
        folder = tempfile.mkdtemp(prefix=FOLDER_PREFIX)
        return folder, [f"--ProfileDir.location={os.path.join(folder, 'profile')}"]
    if mode != "check":
        raise Refused(f"unknown mode {mode!r} (make or check)")
    profile = os.path.normpath(environ.get("IPP_PROFILE_DIR", "") or ".")
    folder = os.path.dirname(profile)
    refuse_shared_tmp(os.path.dirname(folder))
    for path, private in ((folder, True), (profile, False)):
        try:
            problem = folder_problem(os.lstat(path), os.geteuid(), private)
        except OSError as e:
            problem = f"cannot be read ({e.strerror})"
        if problem:
            raise Refused(f"its profile folder {path} {problem}")
    return folder, []


def refuse_shared_tmp(parent: str) -> None:
    """Refused when another user could rename our folder in ``parent`` away and put one of
    theirs in its place (a folder they own, or one others may write without the sticky bit,
    on the way): ipengine would then run their ipengine_config.py. /tmp (sticky) passes."""
    problem = untrusted_ancestor(parent)
    if problem:
        raise Refused(
            f"its temporary folder {parent} is not safe ({problem}); set TMPDIR to a folder "
            "of your own on that host"
        )


def remove_own_folder() -> bool:
    """Remove this engine's folder (INFINI_ENGINE_FOLDER), if it has one: only a folder of
    this user's with mode 0700, named as a session's."""
    from ..launch.watchdog import FOLDER_PREFIX

    folder = os.environ.pop(FOLDER_ENV, "")
    if not os.path.basename(folder).startswith(FOLDER_PREFIX):
        return False
    try:
        if folder_problem(os.lstat(folder), os.geteuid()):
            return False
    except OSError:
        return False
    shutil.rmtree(folder, ignore_errors=True)
    return True


def main(argv: list[str]) -> int:
    mode, rest = (argv[0], argv[1:]) if argv else ("", [])
    try:
        folder, extra = prepare(mode, os.environ)
    except (Refused, OSError) as e:
        print(
            f"infini_notebook: this engine does not start: {e}. ipengine would run the "
            "ipengine_config.py found there, so the session gives each engine a folder of its "
            "own (mode 0700) at every start; another user may have made this one. Remove it "
            "and run %dist_start again.",
            file=sys.stderr,
        )
        return 2
    os.environ[FOLDER_ENV] = folder
    clean = False
    try:
        from ipyparallel.engine.app import main as ipengine

        ipengine([*rest, *extra])
        clean = True
    except SystemExit as e:
        clean = e.code in (0, None)
        raise
    finally:
        if clean or mode == "make":
            remove_own_folder()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
