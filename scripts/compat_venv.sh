#!/usr/bin/env bash
# A venv beside .venv for the compatibility checks (torch_matrix.sh, floor_check.sh): the project editable
# with its daemon's extra and the test tools, under the constraints file given. The engine built in place by
# .venv is reused (same Python; ZEN_NATIVE_BUILD=0). Usage: compat_venv.sh VENV CONSTRAINTS [REQUIREMENT...]
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:?usage: scripts/compat_venv.sh VENV CONSTRAINTS [REQUIREMENT...]}
constraints=${2:?usage: scripts/compat_venv.sh VENV CONSTRAINTS [REQUIREMENT...]}
shift 2
test -x "$venv/bin/python" || "${PYTHON:-python3}" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
ZEN_NATIVE_BUILD=0 "$venv/bin/python" -m pip install -q -c "$constraints" "$@" -e '.[daemon]' pytest pytest-timeout \
    hypothesis expecttest
