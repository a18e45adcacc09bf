"""The rendezvous: the TCPStore the kernel hosts (torchelastic's agent store: it outlives any
rank), the session's unguessable key root, the attempt number and its nonce, and the side
channel through the store (questions to each rank's answering thread, telemetry).
:class:`Rendezvous` is the only writer of all of it."""

from __future__ import annotations

import json
import os
import secrets
import sys
import threading
import time
import warnings
from datetime import timedelta

from ..core import heartbeat, signing
from ..core.errors import DistUsageError
from ..core.plan import LOOPBACK, SessionPlan, is_loopback
from ..engine import rank_services
from ..engine.stdin_relay import prompt_key
from .heartbeat import Heartbeat

ASKS_CAP = 4 << 20  # the stdin question log: a flood past this is dropped whole


class Rendezvous:
    def __init__(self, plan: SessionPlan, kept=None):
        """``kept``: a kept session's connection data (launch/keep.py), whose key root and
        signing key this kernel takes over at attach."""
        self.plan = plan
        # Every key of the session lives under an unguessable root, and each attempt's
        # process groups under a fresh nonce: nobody can prepare keys for a restart.
        self.token = kept.data["token"] if kept else secrets.token_hex(16)
        # Signs what travels through the store (core/signing.py); never written into it.
        self.mac_key = kept.data["mac_key"] if kept else signing.new_key()
        self._forgeries: set[str] = set()  # kinds of forged messages reported already
        self._notices: list[str] = []  # said since the running cell began (take_notices)
        self.attempt = 0
        self._nonce = secrets.token_hex(8)
        self._server = None  # the TCPStore server: it closes with its last reference
        self._heartbeat: Heartbeat | None = None  # for ranks on other hosts (heartbeat.py)
        self._keys = None  # the session's keys in it (a PrefixStore under the root)
        self._late: list[str] = []  # keys of answers nobody waited for
        self._ask_lock = threading.Lock()  # one question to the ranks at a time
        self._prompted = 0  # bytes of the ranks' questions for stdin read so far
        self._answered: dict[str, dict] = {}  # answers given (until the cell ends), by id
        # where the question log ended once each was given: a rank's "again" request
        # written before (while the user typed) is no sign of tampering
        self._answered_at: dict[str, int] = {}
        self._asked: set[str] = set()  # ids of the questions read
        method = plan.init_method
        self._made_init_file = method.kind == "file" and not os.path.exists(method.path)

    @property
    def port(self) -> int:
        return self._server.port

    @property
    def nonce(self) -> str:
        """This attempt's random part of the process groups' store prefix."""
        return self._nonce

    def host(self) -> None:
        """Host the TCPStore here. We bind the listening socket ourselves: TCPStore alone
        listens on every interface, whatever host it is given."""
        import socket

        import torch.distributed as dist

        method = self.plan.init_method
        host = method.host if method.kind == "tcp" else self.plan.bind_address
        port = method.port if method.kind == "tcp" else 0
        if not is_loopback(host):  # allowed (ranks elsewhere need it), but never silently
            encrypted = self.plan.bind_address not in LOOPBACK
            warnings.warn(
                f"Listening on {host}: the rendezvous TCPStore has no authentication, so "
                "anyone who reaches that address can join or disturb the session. Keep it on "
                "a private network."
                + (" ipyparallel's traffic is encrypted (CurveZMQ)." if encrypted else ""),
                stacklevel=3,
            )
        try:
            sock = socket.create_server((host, port), backlog=1024)
            port = sock.getsockname()[1]
            self._server = dist.TCPStore(
                host, port, is_master=True, wait_for_workers=False, master_listen_fd=sock.fileno()
            )
            sock.detach()  # the store owns the descriptor now and closes it
            self._keys = dist.PrefixStore(rank_services.session_root(self.token), self._server)
            # what a remote rank's store watcher follows: the kernel's signed heartbeat
            self._keys.set(heartbeat.ALIVE_KEY, heartbeat.beat(self.mac_key, 0, time.time()))
            if self.plan.placement.multi_host:
                root = rank_services.session_root(self.token)

                def connect():
                    client = dist.TCPStore(
                        host, port, is_master=False, timeout=timedelta(seconds=30)
                    )
                    return dist.PrefixStore(root, client)

                self._heartbeat = Heartbeat(connect, self.mac_key)
        except Exception as e:  # port taken, address not ours
            raise DistUsageError(
                f"Cannot host the rendezvous store on {host}:{port} ({e}). "
                "Pick a free port, or use the default env:// init method."
            ) from None

    def join(self, host: str, port: int) -> None:
        """Use the store a kept session's own process hosts (launch/store_host.py) as a
        client: at its start, and by a kernel that attaches."""
        import torch.distributed as dist

        try:
            self._server = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))
            self._keys = dist.PrefixStore(rank_services.session_root(self.token), self._server)
            self._keys.set(heartbeat.ALIVE_KEY, heartbeat.beat(self.mac_key, 0, time.time()))
        except Exception as e:
            raise DistUsageError(
                f"Cannot reach the session's store at {host}:{port} ({e}). Its processes may "
                "have ended: see %dist_sessions."
            ) from None

    @property
    def address(self) -> tuple[str, int]:
        """Where the ranks reach the store."""
        return self.plan.store_address or self._server.host, self._server.port

    def resume(self, attempt: int) -> None:
        """At attach: the ranks' groups are of ``attempt`` (questions carry it)."""
        self.attempt = attempt

    def next_attempt(self) -> None:
        """A restart's process groups live under a new attempt number and nonce."""
        self.attempt += 1
        self._nonce = secrets.token_hex(8)

    def engine_fields(self) -> dict:
        """What a rank's bootstrap config needs of the rendezvous (see engine.bootstrap)."""
        method = self.plan.init_method
        address = self.plan.store_address or self._server.host  # never 0.0.0.0
        store = {"kind": method.kind, "host": address, "port": self._server.port}
        if method.kind == "file":
            store = {"kind": "file", "path": method.path}
        return {
            "master_addr": address,
            "master_port": self._server.port,
            "store": store,
            "attempt": self.attempt,
            "token": self.token,
            "attempt_key": self._nonce,
            "mac_key": self.mac_key,
        }

    def close(self) -> None:
        """Drop the store (the server closes with its last reference) and a file:// init
        path made for the session (a path the user made stays: it may be theirs)."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        self._keys = None
        self._server = None
        if self._made_init_file:
            try:
                os.remove(self.plan.init_method.path)
            except OSError:
                pass

    def let_go(self) -> None:
        """Drop this kernel's client of a kept session's store, which another kernel drives
        now (or stopped): nothing from here asks it again. The store and its keys stay."""
        self._keys = None
        self._server = None

    # ----- the side channel ---------------------------------------------------------------
    def ask(self, ranks: list[int], question: str | dict[int, str], wait: float) -> dict[int, str]:
        """Ask each rank's answering thread (rank_services) through the store (one question
        for all, or one per rank); the answers that came within ``wait`` seconds. Later ones
        are deleted at the next question."""
        store = self._keys
        if store is None:
            return {}
        with self._ask_lock:  # a running cell asks while %dist_stacks may ask beside it
            for key in self._late:  # answers that came after we stopped waiting
                store.delete_key(key)
            self._late = []
            answers = {}
            for r in ranks:  # each question under an id of our own, never a store counter
                asked = question[r] if isinstance(question, dict) else question
                qid, inbox = signing.new_question_id(), rank_services.stack_key(r, "ask")
                store.set(inbox, signing.pack_question(self.mac_key, inbox, qid, r, asked))
                answers[r] = (qid, signing.question_kind(asked))
            keys = {r: rank_services.stack_key(r, "answer", qid) for r, (qid, _) in answers.items()}
            try:
                store.wait(list(keys.values()), timedelta(seconds=wait))
            except Exception:  # a rank did not answer in time; the others did
                pass
            out: dict[int, str] = {}
            for r, key in keys.items():
                raw = rank_services.peek(store, key)
                if raw is not None:
                    store.delete_key(key)  # one answer per question, taken once
                    qid, kind = answers[r]
                    body = signing.unpack_answer(self.mac_key, key, raw, qid, r, kind)
                    if body is None:
                        self._forged(
                            f"an answer from rank {r}'s answering thread not to its question"
                        )
                    else:
                        out[r] = body
                else:
                    self._late.append(key)
        return out

    def _forged(self, what: str, why: str = "not signed by this session") -> None:
        """A message in the store that our key did not sign: ignored, said once per kind."""
        if what not in self._forgeries:
            self._forgeries.add(what)
            print(f"infini_notebook: {what} was ignored ({why})", file=sys.stderr)
            self._notices.append(f"{what} was ignored ({why})")

    def take_notices(self) -> list[str]:
        """What was said of tampering in the store since the last call: a cell shows it
        again after its output is shown in rank order (which clears what came before)."""
        said, self._notices = self._notices, []
        return said

    def prompts(self) -> list[tuple[str, dict]]:
        """The ranks' questions for stdin (engine/stdin_relay.py) not read yet, in the order
        asked: ``[(id, question)]``, each to be answered with ``answer_prompt(id, reply)``.
        The questions are one appended log: whole lines only, from where we stopped."""
        store, key = self._keys, prompt_key("asks")
        written = rank_services.peek(store, key) if store is not None else None
        if written is None:
            self._log_begun_anew()  # deleted: a new log begins (ranks waiting ask again)
            return []
        if len(written) > ASKS_CAP:  # flooded: dropped whole; ranks that wait ask again
            store.delete_key(key)
            self._log_begun_anew()
            self._forged(
                "a flood of the stdin question log (dropped whole)",
                f"over {ASKS_CAP >> 20} MiB: not what this session's ranks write",
            )
            return []
        if len(written) < self._prompted:  # the log was deleted and begun anew meanwhile
            self._log_begun_anew()
        start, end = self._prompted, written.rfind(b"\n") + 1
        self._prompted = max(start, end)
        out = []
        for at, line in _lines_at(written, start, end):
            body = signing.verify(self.mac_key, key, line)
            try:
                question = json.loads(body)
                n = str(question["id"])
            except (ValueError, KeyError, TypeError):  # not a question our ranks wrote
                self._forged("an unsigned question for stdin")
                continue
            if question.get("again") and n in self._answered:  # our answer never reached it
                if at >= self._answered_at.get(n, 0):  # not one written while the user typed
                    self._answer_again(n, question)
                continue
            if n not in self._asked:  # a question replayed into the log is asked once
                self._asked.add(n)
                out.append((n, question))
        return out

    def answer_prompt(self, n: str, reply: dict) -> None:
        """Answer question ``n``. What the user typed (``input()``, a pdb command, a getpass
        answer) travels sealed: every local user can read every key of the store."""
        if self._keys is None:
            return
        key = prompt_key("answer", n)
        if "value" in reply:
            reply = {"sealed": signing.seal(self.mac_key, key, reply["value"])}
        self._keys.set(key, signing.sign(self.mac_key, key, json.dumps(reply)))
        self._answered[n] = reply
        log = rank_services.peek(self._keys, prompt_key("asks"))
        self._answered_at[n] = len(log) if log is not None else 0

    def _log_begun_anew(self) -> None:
        """The question log was deleted: read from its start, and every "again" request in
        the new one was written after the answers given so far."""
        self._prompted = 0
        self._answered_at = dict.fromkeys(self._answered_at, 0)

    def _answer_again(self, n: str, question: dict) -> None:
        """A rank still waits for the answer we gave to question ``n``: someone deleted or
        garbled it in the store. Written again (once per request), said once; a question
        not answered yet (the user still types) waits for the user."""
        reply = self._answered.get(n)
        if reply is None or self._keys is None:
            return
        key = prompt_key("answer", n)
        self._keys.set(key, signing.sign(self.mac_key, key, json.dumps(reply)))
        said = f"rank {question.get('rank')}'s answer was tampered with in the store; sent again"
        if said not in self._forgeries:
            self._forgeries.add(said)
            self._notices.append(said)

    def drop_unread_answers(self) -> None:
        """Once a cell ended: delete the answers no rank read (it died or was stopped at its
        prompt), so that none lingers in the store, and the question log, read by then (it
        would grow with every pdb command of the session, and be read whole each poll)."""
        answered, self._answered, self._answered_at = list(self._answered), {}, {}
        if self._keys is not None and self._prompted:
            try:
                self._keys.delete_key(prompt_key("asks"))
                self._prompted = 0
            except Exception:  # the store is closing with the session
                pass
        for n in answered:
            try:
                self._keys.delete_key(prompt_key("answer", n))
            except Exception:  # the store is closing with the session
                pass

    def telemetry(self, ranks: list[int]) -> dict[int, dict]:
        """The latest snapshot each rank's telemetry thread put in the store."""
        store = self._keys
        if store is None:
            return {}
        out = {}
        try:
            for r in ranks:
                key = rank_services.telemetry_key(r)
                raw = rank_services.peek(store, key)  # None: not reported yet
                if raw is not None:
                    body = signing.verify(self.mac_key, key, raw)
                    if body is None:
                        self._forged(f"an unsigned telemetry snapshot of rank {r}")
                        continue
                    out[r] = rank_services.parse_telemetry(body)
        except Exception:  # the store is closing with the session: show what we have
            pass
        return out


def _lines_at(written: bytes, start: int, end: int):
    """``(offset, line)`` of each non-empty line of ``written[start:end]``."""
    at = start
    for line in written[start:end].split(b"\n"):
        if line:
            yield at, line
        at += len(line) + 1
