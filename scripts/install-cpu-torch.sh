#!/usr/bin/env bash
# Installs the CPU build of torch into the Python given as $1 (default: python3), before the project.
#
# Why a script: `pip install torch==2.13.0` matches the CUDA wheel on PyPI as well as a local CPU wheel,
# and pip takes the CUDA one (a 5 GB venv of nvidia-* wheels for a CPU demo). The local version label
# `+cpu` matches only the CPU build, so the order below never ends on CUDA by accident:
#   1. a CPU wheel in pip's find-links directories (`pip config list` shows them),
#   2. the PyTorch CPU index (DRESSAGE_TORCH_CPU_INDEX overrides its address),
#   3. only then the default index's build, with a banner saying it is probably a CUDA build.
# DRESSAGE_TORCH_SPEC overrides the version (default torch==2.13.0); set DRESSAGE_TORCH_ALLOW_CUDA=0 to
# make step 3 an error instead.
set -euo pipefail

PY="${1:-python3}"
SPEC="${DRESSAGE_TORCH_SPEC:-torch==2.13.0}"
INDEX="${DRESSAGE_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
PIP=("$PY" -m pip install -q --disable-pip-version-check)

installed_cpu() {
    "$PY" -c 'import sys, torch; sys.exit(0 if torch.version.cuda is None and torch.__version__.endswith("+cpu") else 1)' 2>/dev/null
}

if installed_cpu; then
    exit 0
fi
# PyPI has no +cpu release, so only a wheel in a find-links directory can match here; its dependencies
# (filelock, sympy, ...) still come from the index.
if "${PIP[@]}" "${SPEC}+cpu" 2>/dev/null; then
    echo "torch: ${SPEC}+cpu from a local wheel directory"
    exit 0
fi
if "${PIP[@]}" --retries 1 --timeout 30 --extra-index-url "$INDEX" "${SPEC}+cpu"; then
    echo "torch: ${SPEC}+cpu from $INDEX"
    exit 0
fi
if [ "${DRESSAGE_TORCH_ALLOW_CUDA:-1}" = "0" ]; then
    echo "torch: no CPU build of ${SPEC} found (local wheels, $INDEX) and DRESSAGE_TORCH_ALLOW_CUDA=0" >&2
    exit 1
fi
cat >&2 <<EOF
################################################################################
WARNING: no CPU build of ${SPEC} in a local wheel directory or at $INDEX.
Falling back to the default index, which serves a CUDA build on Linux (several GB).
Set DRESSAGE_TORCH_CPU_INDEX to a reachable CPU index, or put the +cpu wheel in a
pip find-links directory, to avoid it.
################################################################################
EOF
"${PIP[@]}" "$SPEC"
