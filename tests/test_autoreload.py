"""%dist_autoreload (issue 42.8): a module edited on disk between two cells runs as edited on
every rank at the next cell, in the kernel too; off stops that; it stays on across soft and
hard restarts and in a kept session attached from a new kernel. Ranks on another host (the
two-namespace ssh test in test_multinode.py) get the changed files sent; here, the rule, the
cap and what a rank refuses."""

from __future__ import annotations

import os
import secrets

import pytest
from conftest import fresh_kernel, message, text_of

from infini_notebook.core import code_sync, signing

pytestmark = pytest.mark.timeout(600)


def version(n: int) -> str:
    """A module whose f() says which version it is. Each version has its own size: Python
    checks its cached bytecode by size and whole seconds, and the test edits faster."""
    return f"def f():\n    return 'v{n}'{' ' * n}\n"


def edit(folder, n: int) -> None:
    (folder / "armod.py").write_text(version(n))


def ranks_say(cell, n: int, ranks=(0, 1)) -> bool:
    out = text_of(cell)
    return all(f"[rank {r}] v{n}" in out for r in ranks)


def test_edited_module_runs_on_every_rank_across_restarts_and_attach(tmp_path):
    nb = tmp_path / "notebook"
    nb.mkdir()
    edit(nb, 1)
    name = f"ar-{secrets.token_hex(3)}"
    with fresh_kernel() as k:
        k.run(f"import os\nos.chdir({str(nb)!r})")  # the engines start in the notebook's folder
        k.run(f"%dist_start --nprocs 2 --name {name} --keep 2m", timeout=180)
        assert "Autoreload is off" in text_of(k.run("%dist_autoreload"))
        bad = k.run("%dist_autoreload maybe", allow_error=True)
        assert message(bad) == (
            "%dist_autoreload takes on, off, or nothing (to show the state), not 'maybe'."
        )
        assert "Traceback" not in text_of(bad)
        doc = text_of(k.run("print(get_ipython().find_line_magic('dist_autoreload').__doc__)"))
        assert "%dist_autoreload [state ...]" in doc and "kept session" in doc

        said = text_of(k.run("%dist_autoreload on"))
        assert said.startswith("Autoreload is on: the kernel and all 2 ranks") and str(nb) in said
        assert "sent first" not in said  # both ranks see the folder itself
        assert ranks_say(k.run("%%dist\nimport armod\nprint(armod.f())"), 1)
        k.run("import armod")  # the kernel too
        edit(nb, 2)
        assert ranks_say(k.run("%%dist\nprint(armod.f())"), 2)
        assert text_of(k.run("print(armod.f())")).strip() == "v2"

        k.run("%dist_restart")  # soft: the same engines
        edit(nb, 3)
        assert ranks_say(k.run("%%dist\nprint(armod.f())"), 3)
        k.run("%dist_restart --hard", timeout=180)  # new engines get it before their cell
        assert ranks_say(k.run("%%dist\nimport armod\nprint(armod.f())"), 3)
        edit(nb, 4)
        assert ranks_say(k.run("%%dist\nprint(armod.f())"), 4)

        assert "Autoreload is off" in text_of(k.run("%dist_autoreload off"))
        edit(nb, 5)
        assert ranks_say(k.run("%%dist\nprint(armod.f())"), 4)  # the code they had
        assert text_of(k.run("print(armod.f())")).strip() == "v4"
        k.run("%dist_autoreload on")  # a kept session keeps it: the next kernel finds it on
    with fresh_kernel() as k:
        said = text_of(k.run(f"%dist_attach {name}"))
        assert "autoreload on (%dist_autoreload)" in said, said
        assert "Autoreload is on" in text_of(k.run("%dist_autoreload"))
        edit(nb, 6)
        assert ranks_say(k.run("%%dist\nprint(armod.f())"), 6)
        k.run(f"import sys\nsys.path.insert(0, {str(nb)!r})\nimport armod")
        edit(nb, 7)
        assert text_of(k.run("print(armod.f())")).strip() == "v7"  # this kernel's own
        k.run("%dist_stop", timeout=120)


# ----- the rule, the cap, the bundle: no processes ------------------------------------------


def test_which_files_count_and_what_changed(tmp_path):
    (tmp_path / "a.py").write_text("a = 1\n")
    (tmp_path / "notes.txt").write_text("not code\n")
    for skipped in (".git", "__pycache__", ".ipynb_checkpoints", "node_modules"):
        (tmp_path / skipped).mkdir()
        (tmp_path / skipped / "x.py").write_text("")
    (tmp_path / "venv").mkdir()
    (tmp_path / "venv" / "pyvenv.cfg").write_text("")
    (tmp_path / "venv" / "v.py").write_text("")
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "sub" / "m.py").write_text("m = 2\n")
    now = code_sync.scan(str(tmp_path))
    assert sorted(now) == ["a.py", "pkg/__init__.py", "pkg/sub/m.py"]
    assert now["a.py"][1] == 6
    had = dict(now, **{"gone.py": (1, 1), "a.py": (0, 6)})
    change = code_sync.changes(now, had)
    assert sorted(change.send) == ["a.py"] and change.remove == ["gone.py"]
    assert not code_sync.changes(now, now)


def test_over_the_cap_one_line_names_the_files():
    change = code_sync.Changes({f"m{i}.py": (1, 4 * 2**20) for i in range(6)})
    change.send["big.py"] = (1, 10 * 2**20)
    line = code_sync.over_cap_line(change, "/nb", "ranks 2-3")
    assert line.count("\n") == 1 and line.startswith("autoreload: nothing sent to ranks 2-3")
    assert "34.0 MiB, over the 16.0 MiB cap (big.py 10.0 MiB, m0.py 4.0 MiB" in line
    assert "and 2 more" in line


def test_a_rank_writes_only_a_signed_new_bundle_of_safe_paths(tmp_path, monkeypatch):
    from infini_notebook.engine import bootstrap
    from infini_notebook.engine import code_sync as rank_side

    key = signing.new_key()
    monkeypatch.setitem(bootstrap._STATE, "cfg", {"rank": 3, "mac_key": key})
    monkeypatch.setattr(rank_side, "_state", {"folder": None, "manifest": {}, "seq": 0})
    rank_side._state["parent"] = str(tmp_path)

    def bundle(seq, files, remove=(), rank=3, sign_key=key):
        body = code_sync.manifest(rank, seq, files, list(remove))
        tag = signing.sign(sign_key, code_sync.manifest_name(rank), body)[: signing.TAG_LEN]
        stamps = {p: (1, len(d)) for p, d in files.items()}
        return seq, files, stamps, list(remove), tag

    try:
        for bad, why in (
            (bundle(1, {"m.py": b"x = 1\n"}, sign_key=signing.new_key()), "not signed"),
            (bundle(1, {"m.py": b"x = 1\n"}, rank=2), "not signed"),  # another rank's
            (bundle(1, {"../m.py": b""}), "unsafe"),
            (bundle(1, {"/etc/m.py": b""}), "unsafe"),
        ):
            with pytest.raises(ValueError, match=why):
                rank_side.receive(*bad)
        assert os.listdir(tmp_path) == []  # nothing written
        folder = rank_side.receive(*bundle(1, {"m.py": b"x = 1\n", "p/q.py": b""}))
        assert open(os.path.join(folder, "m.py")).read() == "x = 1\n"
        assert os.stat(folder).st_mode & 0o777 == 0o700
        import sys

        assert sys.path[0] == folder
        with pytest.raises(ValueError, match="not newer"):
            rank_side.receive(*bundle(1, {"m.py": b"x = 0\n"}))  # an old one, sent again
        rank_side.receive(*bundle(2, {}, remove=["m.py"]))
        assert not os.path.exists(os.path.join(folder, "m.py"))
    finally:
        import sys

        rank_side.remove_copy()
        sys.path[:] = [p for p in sys.path if not p.startswith(str(tmp_path))]
    assert not os.path.exists(folder)
