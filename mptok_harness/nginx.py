"""A real nginx in front of ``mptok serve`` instances, for the multi-host test and the replay benchmark.

``render_nginx`` fills a template of deploy/ (``@@LISTEN@@``, ``@@SERVERS@@``);
``Nginx`` runs it in the foreground in its own prefix dir and process group,
and kills the group on ``stop()``, at exit too.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

# deploy/nginx-sticky.conf's consistent hash on the conversation header.
HASH_LINE = "hash $http_x_session_id consistent;"


def nginx_binary() -> str | None:
    """nginx on PATH, else Debian's /usr/sbin/nginx (not on a non-root PATH)."""
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None)


def render_nginx(template: Path, listen: str, servers: list[str], round_robin: bool = False) -> str:
    """The template with @@LISTEN@@ and @@SERVERS@@ filled; round_robin drops the hash line."""
    text = template.read_text()
    if round_robin:
        assert HASH_LINE in text
        text = text.replace(HASH_LINE, "# round robin (no hash)")
    lines = "\n        ".join(f"server {s};" for s in servers)
    out = []
    for line in text.splitlines():
        if not line.lstrip().startswith("#"):  # the comments name the placeholders too
            line = line.replace("@@LISTEN@@", listen).replace("@@SERVERS@@", lines)
        out.append(line)
    return "\n".join(out) + "\n"


class Nginx:
    """A real nginx in its own prefix dir, in the foreground, in its own process group;
    ``stop()`` (also at exit) kills the group."""

    def __init__(self, prefix: Path, config: str, port: int, host: str = "127.0.0.1", timeout_s: float = 15.0):
        binary = nginx_binary()
        if binary is None:
            raise RuntimeError("nginx is not installed (apt-get install nginx-light; .ci/run installs it)")
        self.prefix = prefix
        for sub in ("tmp/client_body", "tmp/proxy", "tmp/fastcgi", "tmp/uwsgi", "tmp/scgi"):
            (prefix / sub).mkdir(parents=True, exist_ok=True)
        (prefix / "nginx.conf").write_text(config)
        self._log = open(prefix / "stderr.log", "wb")
        self.process = subprocess.Popen(
            [binary, "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-e", "stderr", "-g", "daemon off;"],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"nginx exited with {self.process.returncode}: {self.log()[-2000:]}")
            try:
                with socket.create_connection((host, port), timeout=0.5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"nginx not listening on {host}:{port} after {timeout_s} s: {self.log()[-2000:]}")
                time.sleep(0.05)

    def log(self) -> str:
        text = (self.prefix / "stderr.log").read_text(errors="replace")
        error_log = self.prefix / "error.log"
        return text + (error_log.read_text(errors="replace") if error_log.exists() else "")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGQUIT)  # graceful
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            pass
        if not self._log.closed:
            self._log.close()

    def __enter__(self) -> Nginx:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
