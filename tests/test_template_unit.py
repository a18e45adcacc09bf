"""The warm template's request loop and its fork checks, in this process over a real Unix
socket: no engine is started and nothing is forked."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from infini_notebook.launch.fork_safety import driver_refusal, open_files
from infini_notebook.launch.template import Template, parse_request
from infini_notebook.launch.template_client import TemplateUnavailable, request


@pytest.fixture
def template_path():
    """A template serving on a socket in a short folder (Unix socket paths are short)."""
    with tempfile.TemporaryDirectory(prefix="tpl") as folder:
        template = Template(os.path.join(folder, "t.sock"))
        stop = threading.Event()

        def serve():
            while not stop.is_set():
                template.poll(0.02)  # serve() without reap(): no children of ours to reap

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        yield template.path
        stop.set()
        thread.join(5)
        template.selector.close()
        template.listener.close()


def exchange(path: str, data: bytes, replies: int = 1) -> list[dict]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(10)
        conn.connect(path)
        conn.sendall(data)
        lines = conn.makefile("rb")
        return [json.loads(lines.readline()) for _ in range(replies)]


BAD_LINES = [
    b"not json",
    b"\xff\xfe",
    b"[1, 2]",
    b'"fork"',
    b'{"op": 3}',
    b'{"argv": []}',
    b'{"op": "wait"}',
    b'{"op": "wait", "pid": "12"}',
    b'{"op": "wait", "pid": true}',
    b'{"op": "fork", "argv": []}',  # checked before anything is forked
    b'{"op": "nanny", "env": {}}',
]


@pytest.mark.parametrize("line", BAD_LINES)
def test_a_malformed_request_is_answered_and_the_template_keeps_serving(template_path, line):
    bad, after = exchange(template_path, line + b'\n{"op": "nope"}\n', replies=2)
    assert bad["error"].startswith("the template could not read a request (")
    assert after == {"error": "unknown request 'nope'"}  # the same connection still served
    with pytest.raises(TemplateUnavailable, match="unknown request 'nope'"):
        request(template_path, {"op": "nope"}, timeout=10)  # and new ones


def test_the_engine_falls_back_with_the_templates_reason(template_path):
    with pytest.raises(TemplateUnavailable, match="'fork' needs env, cwd, output"):
        request(template_path, {"op": "fork", "argv": []}, timeout=10)


@given(st.binary(max_size=64))
def test_any_line_is_a_request_or_a_value_error(line):
    try:
        assert isinstance(parse_request(line), dict)
    except ValueError:
        pass


VALUE = st.none() | st.booleans() | st.integers() | st.text(max_size=4) | st.lists(st.integers())
OP = st.sampled_from(["fork", "nanny", "wait", "info"]) | VALUE


@given(st.fixed_dictionaries({}, optional={"op": OP, "pid": VALUE, "env": VALUE, "fifo": VALUE}))
def test_a_request_that_parses_has_what_its_op_needs(req):
    try:
        parsed = parse_request(json.dumps(req).encode())
    except ValueError:
        return
    assert isinstance(parsed["op"], str)
    if parsed["op"] == "wait":
        assert type(parsed["pid"]) is int


def test_only_an_initialised_cuda_driver_forbids_forking():
    harmless = [
        "/dev/null",
        "socket:[4242]",
        "/dev/nvidiactl",  # NVML (torch.cuda.device_count) opens these and forks stay usable
        "/dev/nvidia0",
        "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
    ]
    assert driver_refusal(harmless) is None
    reason = driver_refusal([*harmless, "/dev/nvidia-uvm"])
    assert "initialised the CUDA driver" in reason and "\n" not in reason


def test_open_files_sees_this_process_files(tmp_path):
    path = str(tmp_path / "held")
    with open(path, "w"):
        assert path in open_files()
    assert path not in open_files()


def test_a_fresh_interpreter_on_this_machine_may_fork():
    """The real check, in a process that imported only the template module."""
    code = (
        "from infini_notebook.launch.fork_safety import driver_refusal, open_files\n"
        "print(driver_refusal(open_files()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "None", out.stderr
