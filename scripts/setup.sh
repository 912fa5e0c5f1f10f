#!/usr/bin/env bash
# CPU development setup: a .venv with the local CPU build of torch 2.13.0 and qerl[dev].
# torch is installed first and pinned through constraints-cpu.txt, so no dependency can pull the
# multi-GB CUDA wheels. Safe to re-run: an up-to-date .venv installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -c constraints-cpu.txt torch==2.13.0
.venv/bin/python -m pip install -q -c constraints-cpu.txt -e ".[dev]"
.venv/bin/python -c "import torch, qerl_cli; print(f'qerl setup ok: torch {torch.__version__}')"
