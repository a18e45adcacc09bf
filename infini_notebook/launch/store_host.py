"""A kept session's TCPStore, hosted by a process of its own so that it outlives the kernel
(see launch/keep.py). Run as ``python -m infini_notebook.launch.store_host HOST PORT
GUARD_PID:START``: it binds HOST:PORT itself (TCPStore alone listens on every interface),
hosts the store there, prints the port it got on one line, then waits until its guard (the
session's watchdog) is gone and exits. It carries the session's mark, so the watchdog and
``%dist_stop`` end it with the rest. Nothing else runs here: the store's keys and their
signatures are the kernel's and the ranks' (``Rendezvous``)."""

from __future__ import annotations

import socket
import sys
import time


def host(address: str, port: int):
    import torch.distributed as dist

    sock = socket.create_server((address, port), backlog=1024)
    port = sock.getsockname()[1]
    store = dist.TCPStore(
        address, port, is_master=True, wait_for_workers=False, master_listen_fd=sock.fileno()
    )
    sock.detach()  # the store owns the descriptor now
    return store, port


def main(argv: list[str]) -> int:
    from .watchdog import parse, same_process

    address, port, guard = argv[0], int(argv[1]), parse(argv[2])
    try:
        store, port = host(address, port)
    except Exception as e:  # the kernel reads this line instead of a port
        print(f"error {type(e).__name__}: {e}", flush=True)
        return 1
    print(port, flush=True)
    sys.stdout.close()  # the kernel stops reading; nothing more is written there
    while same_process(*guard):
        time.sleep(1.0)
    del store
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
