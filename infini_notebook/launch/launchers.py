"""How ipyparallel starts the engines for a plan: local processes, ssh, mpiexec or Slurm.

Pure configuration: ``cluster_options`` and ``engine_options`` turn a SessionPlan into keyword
arguments for ``ipp.Cluster`` and ``Cluster.start_engines``; ipyparallel's own launchers do
the starting. ``assign_ranks`` maps registered engines to global ranks.
"""

from __future__ import annotations

import os
import shlex
import sys

from ..core.errors import DistUsageError
from ..core.plan import LOOPBACK, SessionPlan

# An engine counts as registered once the controller hears its first heartbeat. At the
# default 3 s period that wait was most of a session's start-up (engines up in 6.6 s instead
# of 2.6 s for 4 CPU ranks). Misses allowed are raised so an engine is still declared dead
# after 20 s of silence, close to the default 30 s.
HEARTBEAT = ("--HeartMonitor.period=500", "--HeartMonitor.max_heartmonitor_misses=40")
# ipyparallel's controller, announcing a new engine at its first heartbeat (see controller.py)
CONTROLLER_CMD = ("-m", "infini_notebook.launch.controller")

# ssh: each host's engines in a new private folder there (see ssh.py). Slurm: ipyparallel's
# launcher with sbatch's errors and the job's state (see slurm.py).
LAUNCHER_CLASSES = {
    "local": "local",
    "ssh": "infini_notebook.launch.ssh.SSHEngines",
    "mpi": "mpi",
    "slurm": "infini_notebook.launch.slurm.SlurmEngines",
}

# Engines on other hosts never use the kernel's folder path there (anyone may make it first,
# and ipengine runs the config it finds in its profile): they start through
# engine/remote_start.py, in a new private folder of their own. mpiexec and srun engines make
# it themselves ("make"; the connection comes in IPP_CONNECTION_INFO, and the profile is
# created in it); ssh engines check the one ssh.py made on their host ("check").
# mpiexec hands other hosts only the variables named with -x.
REMOTE_START = ("-m", "infini_notebook.engine.remote_start")
REMOTE_ENGINE_ARGS = ["--IPEngine.auto_create=True"]
IPP_ENV = ("IPP_CONNECTION_INFO", "IPP_CLUSTER_ID", "IPP_PROFILE_DIR")


TEMPLATE_LAUNCHER = "infini_notebook.launch.template_launcher.TemplateEngineSetLauncher"
TEMPLATE_CONTROLLER = "infini_notebook.launch.template_launcher.TemplateControllerLauncher"


def profile_dir(workdir: str) -> str:
    """ipyparallel's profile folder in a session's folder. ipyparallel puts its path in every
    process it launches (IPP_PROFILE_DIR): it marks the session's processes (watchdog.MARK)."""
    return os.path.join(workdir, "profile")


def template_socket(profile_dir: str) -> str:
    """Where the session's warm template listens (see template.py): its folder."""
    return os.path.join(os.path.dirname(profile_dir), "template.sock")


def cluster_options(plan: SessionPlan, profile_dir: str) -> dict:
    launcher = LAUNCHER_CLASSES[plan.placement.launcher]
    opts = {
        "n": plan.world_size,
        "profile_dir": profile_dir,
        "controller_ip": plan.bind_address,
        "engine_launcher_class": launcher if plan.template_off else TEMPLATE_LAUNCHER,
        # forked by the template when it is ready, else started as usual (template_launcher)
        "controller_launcher_class": "local" if plan.template_off else TEMPLATE_CONTROLLER,
        "delay": 0,  # engines wait for the controller's connection info anyway
        "controller_args": list(HEARTBEAT),
    }
    if plan.bind_address not in LOOPBACK:
        # Traffic leaves this machine: encrypt and authenticate ipyparallel's sockets.
        opts["controller_location"] = plan.controller_address or plan.bind_address
        opts["controller_args"].append("--IPController.enable_curve=True")
    return opts


def controller_options(plan: SessionPlan, template_socket: str = "") -> dict:
    """Keyword arguments for ``Cluster.start_controller`` (traits of its launcher):
    ``template_socket``, a ready template's, forks it from there."""
    options = {"controller_cmd": [sys.executable, *CONTROLLER_CMD]}
    if not plan.template_off:
        options["template_socket"] = template_socket
    return options


def engine_env(plan: SessionPlan) -> dict[str, str]:
    """What engines start with beyond the kernel's environment: --env. Threads are set by
    each rank at bootstrap, on its own host (engine.bootstrap.threads_for)."""
    return dict(plan.placement.env)


def template_env(plan: SessionPlan) -> dict[str, str]:
    """The environment a template for ``plan`` starts with: the engines' own, so what an
    interpreter reads as it starts is what a new engine would have read."""
    return dict(os.environ, **engine_env(plan))


def engine_options(plan: SessionPlan, profile_dir: str = "") -> dict:
    """Keyword arguments for ``Cluster.start_engines`` (traits of the engine set launcher)."""
    place = plan.placement
    env = engine_env(plan)
    if place.launcher == "local":
        # No pause between engines: which engine gets which id does not matter (id == rank
        # by definition), and on a busy machine the pauses add up.
        return {"environment": env, "delay": 0}
    if place.launcher == "ssh":
        ssh_args = list(place.ssh_args)
        return {
            "engines": {
                host: {"n": slots, "environment": dict(env, INFINI_HOST_INDEX=str(i))}
                for i, (host, slots) in enumerate(place.hosts)
            },
            "ssh_args": ssh_args,
            "scp_args": [a for a in ssh_args if a != "-T"],
            "remote_python": place.remote_python,
            "engine_cmd": [place.remote_python, *REMOTE_START, "check"],
        }
    if place.launcher == "mpi":
        args = ["--host", ",".join(f"{h}:{n}" for h, n in place.hosts)]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            args.append("--allow-run-as-root")  # containers often run as root
        for key in [*env, *IPP_ENV]:
            args += ["-x", key]  # forward to ranks on every host
        return {
            "environment": env,
            "mpi_args": args,
            "engine_cmd": [sys.executable, *REMOTE_START, "make"],
            "engine_args": list(REMOTE_ENGINE_ARGS),
        }
    if place.launcher == "slurm":
        opts = {
            "environment": env,
            "batch_template": slurm_template(plan),
            "engine_cmd": [sys.executable, *REMOTE_START, "make"],
            "engine_args": list(REMOTE_ENGINE_ARGS),
        }
        if profile_dir:  # sbatch reads the script here; else it lands in the notebook's folder
            opts["batch_file_name"] = os.path.join(profile_dir, "slurm_engines.sbatch")
        return opts
    raise ValueError(place.launcher)


def slurm_template(plan: SessionPlan) -> str:
    """The engines' batch script: one task per rank, ``--ntasks-per-node`` ranks per node.
    ``{n}``, ``{cluster_id}`` and ``{program_and_args}`` are filled in by ipyparallel."""
    place = plan.placement
    lines = [
        "#!/bin/sh",
        "#SBATCH --export=ALL",
        "#SBATCH --job-name=ipengine-{cluster_id}",
        "#SBATCH --output={output_file}",
        "#SBATCH --ntasks={n}",
        f"#SBATCH --nodes={len(place.hosts)}",
        f"#SBATCH --ntasks-per-node={place.hosts[0][1]}",
    ]
    if place.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={place.gpus_per_node}")
    flags = {"partition": "--partition", "account": "--account", "time": "--time"}
    lines += [f"#SBATCH {flags[k]}={v}" for k, v in place.slurm]
    # Braces would be read as template fields by ipyparallel's formatter.
    lines += [
        f"export {k}={shlex.quote(v)}".replace("{", "{{").replace("}", "}}")
        for k, v in engine_env(plan).items()
    ]
    lines.append("srun {program_and_args}")
    return "\n".join(lines) + "\n"


def replacement_options(plan: SessionPlan, profile_dir: str, ranks: list[int]) -> dict:
    """``Cluster.start_engines`` keyword arguments for new engines of ``ranks`` only, each
    on its rank's host: the local launcher's as for a start; ssh's for those hosts, with
    as many engines as ranks there. mpiexec and Slurm place a whole job: refused."""
    place = plan.placement
    if place.launcher not in ("local", "ssh"):
        raise DistUsageError(
            f"Replacing single ranks is not possible with the {place.launcher} launcher (it "
            "starts every rank as one job): run %dist_restart --hard."
        )
    options = engine_options(plan, profile_dir)
    if place.launcher == "ssh":
        places = place.rank_places(plan.world_size)
        wanted: dict[int, int] = {}
        for r in ranks:
            wanted[places[r][0]] = wanted.get(places[r][0], 0) + 1
        hosts = [h for h, _ in place.hosts]
        options["engines"] = {
            hosts[i]: dict(options["engines"][hosts[i]], n=n) for i, n in wanted.items()
        }
    return options


def assign_replacements(identities: dict[int, dict], plan: SessionPlan, ranks: list[int]):
    """{rank: engine id} for new engines of ``ranks`` (``replacement_options``): by host
    index where the engines know it (ssh), in order within a host."""
    eids = sorted(identities)
    if not all(identities[e].get("host_index") is not None for e in eids):
        return dict(zip(sorted(ranks), eids))
    places = plan.placement.rank_places(plan.world_size)
    out = {}
    for r in sorted(ranks):
        eid = next(
            e
            for e in eids
            if int(identities[e]["host_index"]) == places[r][0] and e not in out.values()
        )
        out[r] = eid
    return out


def assign_ranks(identities: dict[int, dict], plan: SessionPlan) -> list[int]:
    """Engine id of every global rank, from what each engine reported (``engine.identity``).

    mpiexec and Slurm number their processes; use that. ssh engines know their host's index;
    within a host, registration order. Local engines: engine id order (id == rank)."""
    eids = sorted(identities)
    if all(identities[e].get("launcher_rank") is not None for e in eids):
        by_rank = sorted(eids, key=lambda e: int(identities[e]["launcher_rank"]))
        return by_rank
    if all(identities[e].get("host_index") is not None for e in eids):
        return sorted(eids, key=lambda e: (int(identities[e]["host_index"]), e))
    return eids


def check_placement(identities: list[dict], plan: SessionPlan) -> None:
    """Refuse ranks that do not run where the plan puts them (identities in rank order,
    from ``engine.identity``). The plan's LOCAL_RANK picks each rank's GPU: a launcher that
    places ranks cyclically (``srun --distribution=cyclic``, ``mpiexec --map-by node``)
    would put two ranks of one host on one GPU. The launcher's own local rank must be the
    plan's, and the ranks the plan puts on one host must report one hostname."""
    places = plan.placement.rank_places(plan.world_size)
    by_host: dict[int, set[str]] = {}
    for rank, ident in enumerate(identities):
        host, local_rank, _ = places[rank]
        by_host.setdefault(host, set()).add(ident["hostname"])
        given = ident.get("launcher_local_rank")
        if given is not None and int(given) != local_rank:
            raise DistUsageError(
                f"Rank {rank} runs on {ident['hostname']} as local rank {given}, but the "
                f"session places it on host {host} as local rank {local_rank} (ranks are "
                f"laid out host by host). {BLOCK_ADVICE}"
            )
    for host, names in sorted(by_host.items()):
        if len(names) > 1:
            raise DistUsageError(
                f"The ranks of host {host} run on {', '.join(sorted(names))}. {BLOCK_ADVICE}"
            )


BLOCK_ADVICE = (
    "The launcher distributed ranks across hosts in another order, so LOCAL_RANK and the "
    "GPU of each rank would be wrong. Place ranks in blocks: no SLURM_DISTRIBUTION=cyclic "
    "(or srun --distribution=block), mpiexec's default --map-by slot."
)


def start_advice(plan: SessionPlan) -> str:
    """What to check when engines cannot start, for where they run."""
    if plan.placement.remote:
        return (
            "Check that the hosts are reachable and run the same Python with "
            "infini_notebook installed."
        )
    return (
        f"The engines run {sys.executable} on this machine: check that it imports "
        "ipyparallel, torch and infini_notebook, and your --env values."
    )
