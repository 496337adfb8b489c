#!/usr/bin/env bash
# Installs the Python client exactly as docs/python.md says, into a fresh venv.
#   install.sh PYTHON VENV    PYTHON: the interpreter Debian's python3-grpcio is installed for
set -euo pipefail
python=$1
venv=$2
package=$(cd "$(dirname "$0")/.." && pwd)
rm -rf "$venv"
"$python" -m venv --system-site-packages "$venv"
"$venv/bin/pip" install --no-build-isolation --no-index "$package"
