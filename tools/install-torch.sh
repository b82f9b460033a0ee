#!/bin/sh
# Install the pinned torch (e.g. torch==2.13.0) into the project's virtual environment,
# as its CPU build on Linux. Usage: sh tools/install-torch.sh .venv/bin/python torch==2.13.0
#
# On Linux, PyPI's torch wheel depends on several GB of CUDA libraries that the book and
# the tests never use; PyTorch's own CPU index has the same release without them. Where
# that index cannot be reached (a mirror-only or offline machine), requirements.txt
# installs torch from the configured index as usual. On macOS PyPI's wheel is the CPU/MPS
# build already, and this script leaves torch to requirements.txt.
set -eu
python=$1
pin=$2
cpu_index=https://download.pytorch.org/whl/cpu

if [ "$(uname -s)" != Linux ]; then
  exit 0
fi
if "$python" -c "import importlib.metadata as m, sys; v = m.version('torch'); sys.exit(v.split('+')[0] != '${pin#torch==}')" 2>/dev/null; then
  echo "==> [2/4] $pin is installed already ($("$python" -c 'import torch; print(torch.__version__)'))"
  exit 0
fi
if "$python" -c "import urllib.request; urllib.request.urlopen('$cpu_index/torch/', timeout=15)" 2>/dev/null; then
  echo "==> [2/4] installing $pin, CPU build, from PyTorch's CPU index (no CUDA libraries)"
  "$python" -m pip install "$pin" --index-url "$cpu_index"
else
  echo "==> [2/4] PyTorch's CPU index is not reachable from here: $pin comes from the configured"
  echo "    package index with the book's requirements (a CPU build where pip's configuration provides one)"
fi
