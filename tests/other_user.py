"""Another local user for the tests of issue 44 ("No one else in"): uid 65534 (nobody), the
attacker. The tests run as root here, so a forked child can become that user (os.setuid);
where they do not run as root they skip. A child does nothing but os calls before it exits."""

from __future__ import annotations

import json
import os
import select
import time

import pytest

OTHER_UID = 65534

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root to act as a second user (uid 65534)"
)


def _become_other() -> None:
    os.setgroups([])
    os.setgid(OTHER_UID)
    os.setuid(OTHER_UID)
    os.umask(0)


def _read_all(fd: int, timeout: float) -> bytes:
    data, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return data
            data += chunk
    raise TimeoutError("the other user's child did not finish")


def as_other(fn, *args, timeout: float = 30):
    """``fn(*args)`` run as uid 65534 in a forked child: its (JSON-able) result, or
    ``{"error": "OSError: ..."}`` for what it raised."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        try:
            os.close(r)
            _become_other()
            out = {"result": fn(*args)}
        except BaseException as e:  # everything goes back to the test
            out = {"error": f"{type(e).__name__}: {e}"}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    try:
        out = json.loads(_read_all(r, timeout))
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    return out.get("result", out)


class Recreator:
    """uid 65534 re-creating files of ours as soon as we remove them, world-writable, with
    ``content``: paths come in through ``watch`` (sent to the child over a pipe); ``stop``
    ends the child and returns what it made, the errors it met and what it then read back
    from the files it made."""

    def __init__(self, content: bytes = b""):
        self.content = content
        self._paths, self._paths_w = os.pipe()
        self._report_r, report_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(self._paths_w)
            os.close(self._report_r)
            try:
                _become_other()
                report = self._run()
            except BaseException as e:
                report = {"error": f"{type(e).__name__}: {e}"}
            os.write(report_w, json.dumps(report).encode())
            os._exit(0)
        os.close(self._paths)
        os.close(report_w)
        self.sent: set[str] = set()

    def watch(self, path: str) -> None:
        if path not in self.sent:
            self.sent.add(path)
            os.write(self._paths_w, (path + "\n").encode())

    def stop(self) -> dict:
        os.write(self._paths_w, b"STOP\n")
        os.close(self._paths_w)
        try:
            return json.loads(_read_all(self._report_r, 30))
        finally:
            os.close(self._report_r)
            os.waitpid(self.pid, 0)

    # ----- in the child ---------------------------------------------------------------------
    def _run(self) -> dict:
        pending: list[str] = []
        made: list[str] = []
        errors: dict[str, str] = {}
        buffer = b""
        while True:
            ready, _, _ = select.select([self._paths], [], [], 0.002)
            if ready:
                buffer += os.read(self._paths, 1 << 16)
                *lines, buffer = buffer.split(b"\n")
                if b"STOP" in lines:
                    break
                pending += [line.decode() for line in lines if line]
            for path in list(pending):
                try:
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
                except FileExistsError:  # still ours: wait until it is removed
                    continue
                except OSError as e:
                    errors[path] = e.strerror
                    continue
                os.fchmod(fd, 0o666)
                os.write(fd, self.content)
                os.close(fd)
                made.append(path)
                pending.remove(path)
        read = {}
        for path in made:
            with open(path, "rb") as f:
                read[path] = f.read().hex()
        return {"made": made, "errors": errors, "read": read}


def popen_as_other() -> dict:
    """``subprocess.Popen`` arguments that run a Python command as uid 65534, when this user is
    root and uid 65534 can run a Python with torch; else {} (the command runs as this user: for
    a store, which cannot tell users apart, what it can reach is the same).

    This interpreter may lie under a folder only this user may enter (pyenv under /root), so
    the system's Python of the same version is tried too, with this venv's site-packages on
    its path (extension modules are built for the version, not the binary)."""
    import shutil
    import site
    import subprocess
    import sys

    if os.geteuid() != 0:
        return {}
    other = {"user": OTHER_UID, "group": OTHER_UID, "extra_groups": [], "cwd": "/"}
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    system = shutil.which(version, path="/usr/local/bin:/usr/bin:/bin")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": os.pathsep.join(site.getsitepackages())}
    for python, extra in ((sys.executable, {}), (system, {"env": env})):
        if python is None:
            continue
        try:
            probe = subprocess.run(
                [python, "-c", "import torch.distributed"], capture_output=True, **other, **extra
            )
        except OSError:  # the interpreter lies under a folder only this user may enter
            continue
        if probe.returncode == 0:
            return {**other, **extra, "executable": python}
    return {}
