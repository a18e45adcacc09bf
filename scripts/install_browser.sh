#!/usr/bin/env bash
# Set-up for the browser test (pytest -m browser): Debian's chromium (no downloaded browser)
# and the Python side (jupyterlab, playwright) into the project's venv.
# Usage: scripts/install_browser.sh [PYTHON]   (default: .venv/bin/python next to this script)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${1:-$here/.venv/bin/python}"

if [ ! -x /usr/bin/chromium ]; then
    sudo=""
    if [ "$(id -u)" != "0" ]; then sudo="sudo"; fi
    export DEBIAN_FRONTEND=noninteractive
    $sudo apt-get update -qq
    $sudo apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
fi
/usr/bin/chromium --version

# playwright drives the system chromium; its own browser download is never used.
"$python" -m pip install -q "jupyterlab>=4" "playwright>=1.40"
"$python" -c "import jupyterlab, playwright; print('jupyterlab', jupyterlab.__version__)"
