"""Execute tutorial notebooks top to bottom in a real kernel; fail on the first error.

    .venv/bin/python scripts/run_notebooks.py notebooks/*.ipynb --out out/notebooks
    .venv/bin/python scripts/run_notebooks.py notebooks/*.ipynb --inplace   # refresh outputs

Executed copies are made static for code hosts (see ``static_outputs``). The committed
notebooks are regenerated from their sources with scripts/notebook_sources/build.py.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from traitlets.config import Config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESTART_TAG = "restart-kernel-before"  # the cell runs in a restarted kernel
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


class Client(NotebookClient):
    """nbclient's, but a cell tagged ``restart-kernel-before`` runs in a restarted kernel,
    restarted as Jupyter's Kernel > Restart does it (jupyter_client's restart_kernel: the
    old kernel's whole process group is signalled): a tutorial shows what survives."""

    async def async_execute_cell(self, cell, cell_index, *args, **kwargs):
        if RESTART_TAG in cell.metadata.get("tags", []):
            await self.km.restart_kernel(now=True)
            await self.kc.wait_for_ready(timeout=self.timeout)
        return await super().async_execute_cell(cell, cell_index, *args, **kwargs)


@contextlib.contextmanager
def client_over_ipc(nb: nbformat.NotebookNode, timeout: int, cls=None):
    """A ``cls`` (this module's Client by default) for ``nb``, whose kernel's sockets are
    files in a folder of our own. Over TCP jupyter_client picks free ports and the kernel
    binds them a moment later; another process can take one in between ('Address already
    in use' and a kernel that never answers, seen once in the suite, whose workers bind
    ports all the time)."""
    folder = tempfile.mkdtemp(prefix="inb-kernel-")
    try:
        yield (cls or Client)(
            nb,
            timeout=timeout,
            kernel_name="python3",
            resources={"metadata": {"path": REPO}},
            config=Config({"KernelManager": {"transport": "ipc", "ip": os.path.join(folder, "k")}}),
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def execute(path: str, timeout: int) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    with client_over_ipc(nb, timeout) as client:
        client.execute()
    return nb


def static_outputs(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Widget outputs -> their static fallback (text/html), or nothing when they have none;
    no saved widget state. GitHub and nbconvert cannot draw live widgets (they render
    blank); re-running the notebook in Jupyter brings them back."""
    states = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        kept = []
        for out in cell.outputs:
            data = out.get("data", {})
            if WIDGET_VIEW in data:
                model = states.get(data[WIDGET_VIEW].get("model_id"), {})
                if model.get("model_name") == "OutputModel":  # e.g. %%dist --background
                    kept += [nbformat.from_dict(o) for o in model["state"].get("outputs", [])]
                    continue
                if "text/html" not in data:
                    continue
                del data[WIDGET_VIEW]
            kept.append(out)
        cell.outputs = kept
    nb.metadata.pop("widgets", None)
    return nb


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", help="folder for the executed copies")
    where.add_argument("--inplace", action="store_true", help="overwrite with outputs")
    parser.add_argument("--timeout", type=int, default=600, help="per cell, seconds")
    args = parser.parse_args()
    for path in args.notebooks:
        t0 = time.perf_counter()
        try:
            nb = static_outputs(execute(path, args.timeout))
        except CellExecutionError as e:
            print(f"FAILED {path}:\n{e}", file=sys.stderr)
            return 1
        target = path if args.inplace else os.path.join(args.out, os.path.basename(path))
        os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
        nbformat.write(nb, target)
        print(f"executed {path} in {time.perf_counter() - t0:.0f}s -> {os.path.abspath(target)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
