#!/usr/bin/env bash
# Set up a development environment in .venv (CPU build of torch unless one is installed already).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  # NOTE: an unpinned torch pulls a multi-GB CUDA build; the CPU wheel is enough for tests and the demo.
  pip install -q "torch==2.13.0" || pip install -q --index-url https://download.pytorch.org/whl/cpu "torch>=2.11,<2.15"
fi
pip install -q -e ".[server,test]"
echo "coserve is set up in .venv"
