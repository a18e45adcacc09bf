#!/usr/bin/env bash
# Set up .venv with the test extra (and the browser), then run the whole test suite.
# Extra arguments go to pytest, e.g. scripts/test.sh -k layout
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
.venv/bin/python -m pytest "$@"
