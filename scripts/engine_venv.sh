#!/bin/sh
# A virtual environment for an engine's tests (vLLM, SGLang): this checkout's
# mptok beside the engine, without installing the engine once per checkout.
#
#   scripts/engine_venv.sh [--without DIST]... [--skip-dependency DIST]... VENV FLAVOUR REQUIREMENT...
#
# --without DIST: a distribution the install brings, removed after it.
# --skip-dependency DIST: a dependency the REQUIREMENTs declare that is not
# installed (one the package index lacks and nothing here imports): the
# REQUIREMENTs are then installed without their dependencies, and their
# other dependencies after them.
#
# An engine venv is 3.5-11 GB and minutes to install, so it is built once per
# machine and kept: in ${MPTOK_ENGINE_VENVS:-$HOME/.cache/mptok/venvs}/
# FLAVOUR-KEY, where KEY is a hash of what it installs (the REQUIREMENTs,
# mptok's own dependencies and test extra from pyproject.toml, the options
# above, the Python version and this script). A later run, another checkout,
# or CI on the same machine with the same KEY reuses it; a change to any of
# them builds a new one beside it (old ones are deleted by hand). Only one
# process builds a given venv (a lock next to it); one interrupted mid-build
# is rebuilt from scratch.
#
# VENV itself is small and per checkout: a venv whose site-packages has a
# .pth line that adds the kept venv's site-packages (with its own .pth files)
# after its own, and mptok installed editable from this checkout with
# --no-deps, so `VENV/bin/python` imports this checkout's mptok and finds its
# entry points (vLLM's general plugin) and everything else in the kept venv.
# Tools start the engine as `VENV/bin/python -m ...`; the kept venv's own
# bin/ scripts run without mptok.
set -eu
WITHOUT=""
SKIP=""
while :; do
    case "${1:-}" in
    --without) WITHOUT="$WITHOUT $2" ;;
    --skip-dependency) SKIP="$SKIP $2" ;;
    *) break ;;
    esac
    shift 2
done
if [ $# -lt 3 ]; then
    echo "usage: $0 [--without DIST]... [--skip-dependency DIST]... VENV FLAVOUR REQUIREMENT..." >&2
    exit 2
fi
VENV=$1
FLAVOUR=$2
shift 2
PYTHON=${PYTHON:-python3}
ROOT=${MPTOK_ENGINE_VENVS:-$HOME/.cache/mptok/venvs}
CHECKOUT=$(cd "$(dirname "$0")/.." && pwd)

# mptok's dependencies and test extra: what the tests import beside the engine.
MPTOK_REQUIREMENTS=$("$PYTHON" - "$CHECKOUT/pyproject.toml" <<'PY'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
print("\n".join(project["dependencies"] + project["optional-dependencies"]["test"]))
PY
)
KEY=$(
    {
        "$PYTHON" -c 'import sys; print(sys.version)'
        printf '%s\n' "$@"
        printf '%s\n' "$MPTOK_REQUIREMENTS"
        echo "without:$WITHOUT skip:$SKIP"
        cat "$0"
    } | sha256sum | cut -c1-16
)
KEPT="$ROOT/$FLAVOUR-$KEY"
mkdir -p "$ROOT"

(
    flock 9
    if [ ! -f "$KEPT/.complete" ]; then
        echo "engine_venv: building $KEPT (minutes; kept for later runs)" >&2
        rm -rf "$KEPT"
        "$PYTHON" -m venv "$KEPT"
        "$KEPT/bin/pip" install --quiet --upgrade pip
        # A file, not argv: requirements hold '<' and ';'.
        if [ -z "$SKIP" ]; then
            printf '%s\n' "$@" "$MPTOK_REQUIREMENTS" >"$KEPT/requirements.txt"
        else
            "$KEPT/bin/pip" install --quiet --no-deps "$@"
            "$KEPT/bin/python" - "$SKIP" "$@" >"$KEPT/requirements.txt" <<'PY'
import importlib.metadata, sys
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name

skip = {canonicalize_name(name) for name in sys.argv[1].split()}
for top in sys.argv[2:]:
    for text in importlib.metadata.requires(Requirement(top).name) or ():
        dependency = Requirement(text)
        if canonicalize_name(dependency.name) not in skip and (dependency.marker is None or dependency.marker.evaluate({"extra": ""})):
            print(text)
PY
            printf '%s\n' "$MPTOK_REQUIREMENTS" >>"$KEPT/requirements.txt"
        fi
        "$KEPT/bin/pip" install --quiet -r "$KEPT/requirements.txt"
        if [ -n "$WITHOUT" ]; then
            # shellcheck disable=SC2086  # a list of distributions
            "$KEPT/bin/pip" uninstall --quiet --yes $WITHOUT 2>/dev/null || true
        fi
        touch "$KEPT/.complete"
    fi
) 9>"$KEPT.lock"

rm -rf "$VENV"
"$PYTHON" -m venv --without-pip "$VENV"
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
KEPT_SITE=$("$KEPT/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
echo "import site; site.addsitedir('$KEPT_SITE')" >"$SITE/mptok-engine-venv.pth"
# pip comes from the kept venv (through the .pth) and installs into VENV.
"$VENV/bin/python" -m pip install --quiet --no-deps -e "$CHECKOUT"
echo "engine_venv: $VENV uses $KEPT" >&2
