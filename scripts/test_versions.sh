#!/usr/bin/env bash
# Runs the tests that depend on CPython's multiprocessing internals (the
# manager transport, routing, process faults) on every other Python version
# that pyproject.toml declares. 3.12 changed the authkey handshake; the
# transport speaks both. Each version gets its own virtual environment.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
    local version=$1 candidate
    for candidate in "python$version" "$(pyenv root 2>/dev/null)"/versions/"$version".*/bin/"python$version"; do
        if "$candidate" -c 'import sys' >/dev/null 2>&1; then
            echo "$candidate"
            return 0
        fi
    done
    return 1
}

for version in 3.12 3.13; do
    if ! python=$(find_python "$version"); then
        echo "test_versions: no Python $version on this machine, which pyproject.toml declares" >&2
        exit 1
    fi
    venv=".venv-$version"
    if [ ! -f "$venv/.installed" ] || [ pyproject.toml -nt "$venv/.installed" ]; then
        "$python" -m venv "$venv"
        "$venv/bin/pip" install --quiet --upgrade pip
        "$venv/bin/pip" install --quiet -e '.[test]'
        touch "$venv/.installed"
    fi
    echo "== Python $version: transport, routing and fault tests"
    "$venv/bin/python" -m pytest -q -m "not slow" tests/test_transport.py tests/test_routing.py tests/test_faults.py
done
