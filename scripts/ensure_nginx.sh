#!/usr/bin/env bash
# tests/test_multihost.py runs a real nginx in front of two `mptok serve`
# hosts; install Debian's nginx-light when no nginx is on the machine.
set -euo pipefail
if command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "ensure_nginx: nginx is missing and installing it needs root: sudo apt-get install nginx-light" >&2
    exit 1
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light \
    || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx
