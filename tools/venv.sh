#!/usr/bin/env bash
# Set up .venv: find a Python >= 3.12 on this machine, make the virtual environment with it and
# install runner (editable) with the test and tpu extras. The README's two commands and .ci/run
# start here. Safe to run again: an existing .venv of a new enough Python is reused.
#
# Where it looks, in order: $RUNNER_PYTHON, python3.12, python3.13, python3, python on PATH,
# then pyenv's versions (~/.pyenv/versions/3.1x.y). A pyenv shim for a version that is installed
# but not selected fails its version check and is skipped, so the version itself is found next.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1

new_enough() {
    "$1" -c 'import sys, venv; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1
}

find_python() {
    local candidate
    for candidate in "${RUNNER_PYTHON:-}" python3.12 python3.13 python3 python; do
        if [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1 && new_enough "$candidate"; then
            command -v "$candidate"
            return 0
        fi
    done
    for candidate in $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9]* 2>/dev/null | sort -V); do
        if new_enough "$candidate/bin/python3"; then
            echo "$candidate/bin/python3"
            return 0
        fi
    done
    return 1
}

if [ -x .venv/bin/python ] && ! new_enough .venv/bin/python; then
    echo "tools/venv.sh: .venv is $(.venv/bin/python -V 2>&1), older than runner needs (3.12+); making it anew." >&2
    rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
    if ! python=$(find_python); then
        echo "error: runner needs Python 3.12 or newer, and none was found (looked for python3.12, python3.13," \
             "python3 and python on PATH, and in ${PYENV_ROOT:-$HOME/.pyenv}/versions). Fix: install one" \
             "(e.g. 'pyenv install 3.12', 'uv python install 3.12' or 'apt-get install python3.12-venv')," \
             "or name it with RUNNER_PYTHON=/path/to/python3.12, then run this again." >&2
        exit 2
    fi
    echo "tools/venv.sh: making .venv with $python ($("$python" -V 2>&1))" >&2
    "$python" -m venv .venv
fi
.venv/bin/pip install -q -e '.[test,tpu]'
