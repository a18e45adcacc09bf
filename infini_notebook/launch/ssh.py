"""ssh engines in a folder of their own on each host.

ipyparallel's ssh launcher puts the engines' profile (ipengine runs the ipengine_config.py
it finds there), the connection file and each engine's output in ``remote_profile_dir`` on
the host: by default the kernel's own folder path (/tmp/infini-notebook-XXXX/profile), which
every user of that host can see in ``ps`` and make first. This launcher makes a new folder on
each host before its engines start (``tempfile.mkdtemp`` over ssh: mode 0700, a random name
at each start) and gives that host's engines a profile in it. The engines check the folder
before ipengine reads anything there and remove it once their rank is set up
(engine/remote_start.py); the kernel removes what a failed start left (startup.py).
"""

from __future__ import annotations

import os
import shlex
import subprocess

from ipyparallel.cluster.launcher import SSHEngineLauncher, SSHEngineSetLauncher

from .watchdog import FOLDER_PREFIX

MAKE_FOLDER = "import tempfile; print(tempfile.mkdtemp(prefix={prefix!r}))\n"


def split_host(host: str) -> tuple[str, str | None]:
    """([user@]host for ssh, its port or None) from an --hosts name, as ipyparallel reads it."""
    location, _, port = host.partition(":")
    return location, port or None


def made_folder(stdout: str) -> str | None:
    """The folder MAKE_FOLDER printed (its last line: a login may print more), or None."""
    lines = stdout.strip().splitlines()
    path = lines[-1].strip() if lines else ""
    if os.path.isabs(path) and os.path.basename(path).startswith(FOLDER_PREFIX):
        return path
    return None


def relay_command(host: str, ssh_args, remote_python: str, env: dict[str, str]):
    """A function that turns a relay's arguments into the ssh command that runs it on
    ``host`` (launch/relay.py), with the engines' --env (ssh does not carry the kernel's)
    and ssh's stdin as its lifeline."""
    location, port = split_host(host)
    ssh = ["ssh", *ssh_args, *(["-p", port] if port else []), location]
    assignments = [f"{k}={v}" for k, v in env.items()]

    def command(args: list[str]) -> list[str]:
        return [*ssh, shlex.join(["env", *assignments, remote_python, *args])]

    return command


class SSHEngine(SSHEngineLauncher):
    def get_output(self, remove=False):
        """The engine's output, or "" once its folder is gone (its rank was set up): without
        the file, ipyparallel would wait 10 s for it to appear."""
        if self._output is None:
            try:
                gone = not self.ssh_sender.cmd_exists(self.remote_output_file)
            except Exception:
                gone = True
            if gone:
                self._output = ""
        return super().get_output(remove)


class SSHEngines(SSHEngineSetLauncher):
    """ipyparallel's ssh engine set, each host's engines in a new private folder there."""

    launcher_class = SSHEngine

    def start(self, n):
        for host, config in list(self.engines.items()):
            config = config if isinstance(config, dict) else {"n": config}
            config["remote_profile_dir"] = os.path.join(self.private_folder(host), "profile")
            self.engines[host] = config
        return super().start(n)

    def private_folder(self, host: str) -> str:
        """A new folder of ours on ``host`` (mode 0700), made over ssh."""
        location, port = split_host(host)
        ssh = [*self.ssh_cmd, *self.ssh_args, *(["-p", port] if port else []), location]
        try:
            out = subprocess.run(
                [*ssh, self.remote_python, "-"],
                input=MAKE_FOLDER.format(prefix=FOLDER_PREFIX),
                capture_output=True,
                text=True,
                timeout=60,
            )
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"ssh to {host} did not answer in 60 s") from None
        path = made_folder(out.stdout) if out.returncode == 0 else None
        if path is None:
            said = (out.stderr or out.stdout).strip() or f"ssh exited with {out.returncode}"
            raise RuntimeError(
                f"could not make the engines' folder on {host} with {self.remote_python}: {said}"
            )
        return path
