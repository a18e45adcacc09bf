"""A widget a rank shows (tqdm.auto's bar, a slider) sits on one line with its rank's label:
``[rank 2] r2: 48%|████      | 12/25``. Runs inside each engine.

The widget's model lives on the rank (ipyparallel relays its comm to the notebook), so only
the rank can build a box holding it: the rank's display publisher shows an HBox of the label
and the widget in its place. The display's metadata says so (``LABELED_WIDGET``), and the
kernel prints no label line of its own above it. Its text/plain (tqdm's text bar) is kept.
"""

from __future__ import annotations

import sys

from ..core.transcript import LABELED_WIDGET, WIDGET_MIME

_state: dict = {"boxes": {}}  # model_id -> the HBox that shows it


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
    # ipywidgets 8 keeps every open widget by model id (ipywidgets/widgets/widget.py,
    # ``_instances``; ``Widget.widgets`` is its deprecated public name).
    instances = getattr(
        getattr(getattr(widgets, "widgets", None), "widget", None), "_instances", {}
    )
    widget = instances.get(model_id)
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
        if box is not None:
            box.children[0].close()
            box.close()
