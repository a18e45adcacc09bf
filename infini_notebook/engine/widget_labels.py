"""A widget a rank shows (tqdm.auto's bar, a slider) sits on one line with its rank's label:
``[rank 2] r2: 48%|████      | 12/25``. Runs inside each engine.

The widget's model lives on the rank (ipyparallel relays its comm to the notebook), so only
the rank can build a box holding it: the rank's display publisher shows an HBox of the label
and the widget in its place. The display's metadata says so (``LABELED_WIDGET``), and the
kernel prints no label line of its own above it. Its text/plain (tqdm's text bar) is kept.

What a widget's callback prints (a Button's ``on_click``) is shown there too, at once: in
the Output widget that captures it (``with out:``, ``interact``'s), else in an Output added
to the box of the widget whose comm message runs the callback. ipyparallel relays only comm
messages to the notebook, so an Output's captured stream never got there; its state does.
"""

from __future__ import annotations

import sys
import threading

from ..core.transcript import LABELED_WIDGET, WIDGET_MIME

_state: dict = {"boxes": {}, "outputs": {}}  # model_id -> the HBox that shows it, its Output
CALLBACK_CHARS = 20_000  # an Output under a widget keeps the last of what callbacks print
_writing = threading.local()  # an Output's update that writes (a warning) is not shown again


def install(shell) -> bool:
    """Hook the shell's display publisher; whether it is in place."""
    if "installed" in _state:
        return _state["installed"]
    pub = getattr(shell, "display_pub", None)
    ok = callable(getattr(pub, "publish", None))
    if ok:
        original = pub.publish

        def publish(data, metadata=None, *args, **kwargs):
            data, metadata = labeled(data, metadata, shell.user_ns.get("rank"))
            return original(data, metadata, *args, **kwargs)

        pub.publish = publish
    _state["installed"] = ok
    return ok


def labeled(data, metadata, rank) -> tuple:
    """``data`` showing the widget it names in a box after ``[rank N]``, or as it was (not
    a widget, no rank yet, or the widget unknown here)."""
    view = data.get(WIDGET_MIME) if isinstance(data, dict) else None
    if not isinstance(view, dict) or rank is None or (metadata or {}).get(LABELED_WIDGET):
        return data, metadata
    box = _box_for(view.get("model_id"), rank)
    if box is None:
        return data, metadata
    data = dict(data, **{WIDGET_MIME: dict(view, model_id=box.model_id)})
    return data, dict(metadata or {}, **{LABELED_WIDGET: True})


def _box_for(model_id, rank):
    widgets = sys.modules.get("ipywidgets")  # a widget was made, so ipywidgets is loaded
    widget = _instances(widgets).get(model_id)
    if widget is None or isinstance(widget, widgets.Output):  # an Output captures, not shows
        return None
    box = _state["boxes"].get(model_id)
    if box is None or box.comm is None:
        label = widgets.HTML(f"<code>[rank {rank}]</code>")
        label.layout.margin = "0 6px 0 0"
        box = widgets.HBox([label, widget])
        box.layout.align_items = "center"
        _state["boxes"][model_id] = box
        widget.observe(lambda change: _closed(model_id, change), names="comm")
    return box


def _closed(model_id, change) -> None:
    """The widget closed (tqdm's ``leave=False`` bar at its end): its label goes with it."""
    if change["new"] is None:
        box = _state["boxes"].pop(model_id, None)
        out = _state["outputs"].pop(model_id, None)
        if out is not None:
            out.close()
        if box is not None:
            box.children[0].close()
            box.close()


def show_callback_text(name: str, text: str, header: dict) -> bool:
    """Show ``text`` that a widget's callback wrote to stream ``name`` (for the comm message
    ``header``) in the notebook now; whether it could (no widget found: it cannot)."""
    widgets = sys.modules.get("ipywidgets")
    if widgets is None or getattr(_writing, "on", False):
        return False
    _writing.on = True
    try:
        out = _capturing(widgets, header.get("msg_id")) or _under(widgets, _comm_id(header))
        if out is None:
            return False
        _append(out, name, text)
        return True
    except Exception:  # a widget closed meanwhile: the text goes late, as without one
        return False
    finally:
        _writing.on = False


def _instances(widgets) -> dict:
    # ipywidgets 8 keeps every open widget by model id (ipywidgets/widgets/widget.py,
    # ``_instances``; ``Widget.widgets`` is its deprecated public name).
    return getattr(getattr(getattr(widgets, "widgets", None), "widget", None), "_instances", {})


def _capturing(widgets, msg_id):
    """The Output widget whose ``with`` block runs for this message (it keeps its id)."""
    if not msg_id:
        return None
    for widget in list(_instances(widgets).values()):
        if isinstance(widget, widgets.Output) and widget.msg_id == msg_id:
            return widget
    return None


def _comm_id(header: dict):
    """The comm the message being handled is for (its content holds it)."""
    from IPython import get_ipython

    parent = get_ipython().kernel.get_parent("shell") or {}
    if (parent.get("header") or {}).get("msg_id") != header.get("msg_id"):
        return None
    return (parent.get("content") or {}).get("comm_id")


def _under(widgets, comm_id):
    """The Output under the shown widget that is (or holds) the comm's widget."""
    if comm_id is None:
        return None
    for model_id, box in list(_state["boxes"].items()):
        if box.comm is not None and _holds(box.children[1], comm_id):
            out = _state["outputs"].get(model_id)
            if out is None:
                out = _state["outputs"][model_id] = widgets.Output()
                out.layout.margin = "0 0 0 8px"
                box.children = (*box.children, out)
            return out
    return None


def _holds(widget, model_id, depth: int = 0) -> bool:
    if getattr(widget, "model_id", None) == model_id:
        return True
    children = getattr(widget, "children", ()) if depth < 20 else ()
    return any(_holds(child, model_id, depth + 1) for child in children)


def _append(out, name: str, text: str) -> None:
    """``text`` added to the Output's last part when of the same stream, kept short."""
    outputs = list(out.outputs)
    last = outputs[-1] if outputs else {}
    if last.get("output_type") == "stream" and last.get("name") == name:
        outputs[-1] = dict(last, text=(last["text"] + text)[-CALLBACK_CHARS:])
    else:
        outputs.append({"output_type": "stream", "name": name, "text": text})
    out.outputs = tuple(outputs)
