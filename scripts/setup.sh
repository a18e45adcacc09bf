#!/usr/bin/env bash
# Create or refresh .venv at the repo root. Usage: scripts/setup.sh [--test | --notebooks]
#   --test       also the test extra, the browser the widget tests drive, sshd and OpenMPI
#   --notebooks  also what running the tutorials headless needs (nbclient)
# Re-running is cheap: the install is skipped while pyproject.toml is unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."

extra=""
case "${1:-}" in
    --test) extra="[test]" ;;
    --notebooks) extra="[notebooks]" ;;
    "") ;;
    *) echo "usage: scripts/setup.sh [--test | --notebooks]" >&2; exit 2 ;;
esac

if [[ ! -x .venv/bin/python ]]; then
    python3 -m venv .venv
fi

stamp=".venv/.infini-installed${extra//[^a-z]/}"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
    echo "setup: installing into .venv (first run takes a few minutes)..."
    .venv/bin/python -m pip install -q --upgrade pip
    if ! command -v nvidia-smi >/dev/null 2>&1; then
        # CPU machine: the CPU build of torch, not the multi-GB CUDA one.
        .venv/bin/python -m pip install -q "torch==2.13.0"
    fi
    .venv/bin/python -m pip install -q -e ".${extra}"
    echo "$want" > "$stamp"
fi

if [[ "$extra" == "[test]" ]]; then
    scripts/install_browser.sh
    scripts/install_multinode.sh || echo "setup: no sshd/OpenMPI; the multi-host tests will skip"
fi
