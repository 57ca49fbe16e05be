"""A frontend's sign of life, so that its supervisor can tell a hung frontend from a busy one.

A frontend that is SIGSTOPped, or whose event loop is stuck, still holds
the connections it accepted, which nobody answers, and its process never
exits. So the frontend's event loop touches a file in the ipc directory
every ``INTERVAL_S`` (``Heartbeat``: it beats only while the loop runs), and
the supervisor kills a ready frontend whose file is older than its hang
timeout (``age_s``); the exit is then restarted as any other.

A file's modification time, not a pipe: a frontend never blocks on a
supervisor that is slow to read, and the supervisor reads it in a stat.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

INTERVAL_S = 1.0


def heartbeat_path(ipc_dir: str, frontend_id: int) -> str:
    return os.path.join(ipc_dir, f"heartbeat-{frontend_id}")


def age_s(ipc_dir: str, frontend_id: int) -> float | None:
    """Seconds since frontend ``frontend_id`` last beat; None if it never did (or its file is gone)."""
    try:
        beat = os.stat(heartbeat_path(ipc_dir, frontend_id)).st_mtime
    except FileNotFoundError:
        return None
    return time.time() - beat


class Heartbeat:
    """Touches frontend ``frontend_id``'s heartbeat file every ``INTERVAL_S`` from the running event loop.

    ``start()`` (on that loop) beats at once and then in a task; ``stop()``
    cancels the task and removes the file, so that the next process of this
    id starts with no stale beat.
    """

    def __init__(self, ipc_dir: str, frontend_id: int):
        self._path = heartbeat_path(ipc_dir, frontend_id)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._beat()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="mptok-heartbeat")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(INTERVAL_S)
            self._beat()

    def _beat(self) -> None:
        # O_NOFOLLOW: the ipc dir is private, and a link in it is never followed.
        fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.utime(fd)
        finally:
            os.close(fd)
