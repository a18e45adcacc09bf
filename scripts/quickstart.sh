#!/usr/bin/env bash
# The main job: set up .venv, then run the quickstart notebook headless (CPU ranks on gloo
# when there is no GPU) and print where the executed copy is.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --notebooks
.venv/bin/python scripts/run_notebooks.py notebooks/01_quickstart.ipynb --out out/notebooks
