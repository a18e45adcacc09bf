"""Pure logic: options, the plan, the layout, rank specs, output labeling, waits, busbw,
export. Nothing here imports torch, ipyparallel, IPython or ipywidgets at import time
(tests/test_imports.py checks it), so it is tested in milliseconds without processes."""
