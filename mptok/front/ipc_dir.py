"""The private directory and authkey that the tokenizing processes of one engine server share.

In vLLM and SGLang the engine's server process runs no mptok code before it
spawns the processes that tokenize, so those agree among themselves:

- the directory is named after their parent's pid and start time in clock
  ticks (``/proc/<pid>/stat``), so two servers never share one, even when
  a pid is reused; made 0700 by whichever process comes first and checked
  by every one (``secure_ipc_dir``);
- the authkey is 32 random bytes in a 0600 file in it, published with
  ``link`` (atomic, and a second writer loses instead of replacing it);
  never in argv, the environment or a log;
- every process holds a shared ``flock`` on ``supervisor.lock`` while it
  lives. The last to close removes the directory; those of a SIGKILLed
  server are removed by the next one to start (never a link, another
  user's directory, or one with a lock held).

The name starts with ``mptok-serve-`` and holds the same ``supervisor.lock``
as an ``mptok serve`` directory, so either sweep may remove the other's
stale directories by the same rule.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
import tempfile

from mptok.core.deadline import Deadline
from mptok.core.file_locks import lock_by, try_lock
from mptok.core.private_files import SERVER_LOCK, remove_if_unused, secure_ipc_dir, sweep_unused
from mptok.routing.liveness import start_ticks

logger = logging.getLogger("mptok")

PREFIX = "mptok-serve-engine-"
LOCK_NAME = SERVER_LOCK
KEY_NAME = "authkey"
KEY_BYTES = 32
# A sweep holds a directory's lock exclusively only while it removes it;
# joining waits that long at most, and tries a new directory this often.
_JOIN_WAIT_S = 2.0
_JOIN_ATTEMPTS = 3
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC


class SharedIpcDir:
    """The ipc directory of the engine's server process ``server_pid`` (default: the parent), joined.

    ``path`` and ``authkey`` are the same in every process of that server.
    Raises ``PermissionError`` for a directory that is not this user's alone,
    ``ProcessLookupError`` when ``server_pid`` is gone, ``OSError`` when it
    cannot be made. ``close()`` leaves it (removed if unused); idempotent.
    """

    def __init__(self, server_pid: int | None = None):
        server_pid = os.getppid() if server_pid is None else server_pid
        ticks = start_ticks(server_pid)
        if ticks is None:
            raise ProcessLookupError(f"server process {server_pid} is gone")
        self.path = os.path.join(tempfile.gettempdir(), f"{PREFIX}{server_pid}-{ticks}")
        for stale in sweep_unused(tempfile.gettempdir(), PREFIX, self.path):
            logger.warning("mptok: removed the ipc dir %s of a server that is gone", stale)
        self._lock_fd: int | None = _join(self.path)
        try:
            self.authkey = _shared_key(self.path)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._lock_fd is None:
            return
        fd, self._lock_fd = self._lock_fd, None
        os.close(fd)
        with contextlib.suppress(OSError):
            remove_if_unused(self.path)


def _join(path: str) -> int:
    """A shared lock on ``path``'s ``supervisor.lock``, making both if missing."""
    for _ in range(_JOIN_ATTEMPTS):
        secure_ipc_dir(path)
        dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _OPEN_FLAGS)
        try:
            fd = _locked_shared(dir_fd)
            # Still the directory's lock, in the directory at ``path``: a
            # sweep that removed it meanwhile leaves us an orphan file.
            with contextlib.suppress(FileNotFoundError):
                if (
                    os.stat(LOCK_NAME, dir_fd=dir_fd, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
                    and os.lstat(path).st_ino == os.fstat(dir_fd).st_ino
                ):
                    return fd
            os.close(fd)
        finally:
            os.close(dir_fd)
    raise OSError(f"could not join the ipc dir {path}: it was removed {_JOIN_ATTEMPTS} times while joining")


def _locked_shared(dir_fd: int) -> int:
    """``supervisor.lock`` in ``dir_fd``, opened and share-locked; created (0600) if missing."""
    try:
        fd = os.open(LOCK_NAME, os.O_RDONLY | _OPEN_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        with contextlib.suppress(FileExistsError):  # else another process's won
            return publish_locked(dir_fd, LOCK_NAME, shared=True)
        fd = os.open(LOCK_NAME, os.O_RDONLY | _OPEN_FLAGS, dir_fd=dir_fd)
    if lock_by(fd, Deadline.after(_JOIN_WAIT_S), shared=True):
        return fd
    os.close(fd)
    raise BlockingIOError(f"{LOCK_NAME} held exclusively for more than {_JOIN_WAIT_S:g} s (a sweep that did not end)")


def publish_locked(dir_fd: int, name: str, *, shared: bool) -> int:
    """A new 0600 lock file ``name`` in ``dir_fd``, locked (``FileExistsError`` if there is one). Made under a private
    name and locked, then linked: a lock file never appears unlocked, so a sweep cannot take a starting server's dir."""
    pending = f".{name}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(pending, os.O_RDWR | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, 0o600, dir_fd=dir_fd)
    try:
        if not try_lock(fd, shared=shared):  # a file just made under this process's own name
            raise OSError(f"{pending} is locked by another process")
        os.link(pending, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        os.close(fd)
        raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(pending, dir_fd=dir_fd)
    return fd


def _shared_key(path: str) -> bytes:
    """The authkey in ``path``, written there first if missing."""
    dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _OPEN_FLAGS)
    try:
        with contextlib.suppress(FileNotFoundError):
            return _read_key(dir_fd)
        pending = f".{KEY_NAME}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(pending, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, 0o600, dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(KEY_BYTES))
            with contextlib.suppress(FileExistsError):  # another process's key won
                os.link(pending, KEY_NAME, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(pending, dir_fd=dir_fd)
        return _read_key(dir_fd)
    finally:
        os.close(dir_fd)


def _read_key(dir_fd: int) -> bytes:
    fd = os.open(KEY_NAME, os.O_RDONLY | _OPEN_FLAGS, dir_fd=dir_fd)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise PermissionError("the mptok authkey file is not a private file of this user")
        key = f.read(KEY_BYTES + 1)
    if len(key) != KEY_BYTES:
        raise PermissionError(f"the mptok authkey file holds {len(key)} bytes, not {KEY_BYTES}")
    return key
