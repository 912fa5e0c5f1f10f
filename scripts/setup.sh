#!/usr/bin/env bash
# CPU development setup: a .venv with the local CPU build of torch 2.13.0 and qerl[dev].
# torch is installed first and pinned through constraints-cpu.txt, so no dependency can pull the
# multi-GB CUDA wheels. Safe to re-run: when .venv's qerl is this checkout's editable install and
# pyproject.toml and the constraints have not changed since (a stamp in .venv), it installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
stamp=.venv/.qerl-setup-stamp
# What the install depends on: this checkout's location and the files that decide what pip installs.
root=$(pwd -P)
want="$root $(cat pyproject.toml constraints-cpu.txt | sha256sum | cut -d' ' -f1)"
[ -x .venv/bin/python ] || "$python" -m venv .venv
# The editable install must point here (a .venv copied from another checkout imports that one's code).
# Asked from / so that Python finds qerl_cli through the install, not in the current folder.
here=$(cd / && "$root/.venv/bin/python" -c \
    "import pathlib, qerl_cli; print(pathlib.Path(qerl_cli.__file__).resolve().parents[1])" 2>/dev/null || true)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ "$here" = "$root" ]; then
    echo "qerl setup ok: .venv is up to date (delete $stamp to reinstall)"
    exit 0
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -c constraints-cpu.txt torch==2.13.0
.venv/bin/python -m pip install -q -c constraints-cpu.txt -e ".[dev]"
.venv/bin/python -c "import torch, qerl_cli; print(f'qerl setup ok: torch {torch.__version__}')"
echo "$want" > "$stamp"
