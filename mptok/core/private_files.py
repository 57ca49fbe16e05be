"""The private ipc directory and the files in it: this user's, and never reached through a link.

The frontends of one server share a directory of sockets, lock files,
records and metrics snapshots; with the authkey, its permissions keep other
users away from all of it, so every layer opens what is there through here.
``remove_if_unused`` is the one rule by which every sweep removes the
directories of servers that are gone.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat

from mptok.core.file_locks import try_lock


def secure_ipc_dir(path: str) -> str:
    """Create ``path`` (mode 0700) if missing and check, on the opened directory, that only this user can enter it;
    ``PermissionError`` for a link, another user's directory or any access by others, ``NotADirectoryError``."""
    return _own_directory(path, "ipc dir", 0o077, "have no access to it (chmod 700 {path})")


def private_cache_dir(path: str) -> str:
    """``secure_ipc_dir`` for what this user keeps between runs (``mptok.engines.memo``):
    others may read it, as the rest of a home directory, but not write in it."""
    return _own_directory(path, "directory", 0o022, "not write in it (chmod go-w {path})")


def _own_directory(path: str, what: str, forbidden: int, rule: str) -> str:
    """``path`` made absolute, created (mode 0700) if missing; ``PermissionError``
    for a link, another user's directory, or a mode with a ``forbidden`` bit."""
    path = os.path.abspath(path)
    with contextlib.suppress(FileExistsError):
        os.makedirs(path, mode=0o700)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if os.path.islink(path):
            raise PermissionError(f"{what} {path} is a symbolic link; give mptok a real directory") from None
        if e.errno == errno.ENOTDIR:
            raise NotADirectoryError(f"{what} {path} is not a directory") from None
        raise
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if st.st_uid != os.geteuid():
        raise PermissionError(
            f"{what} {path} belongs to uid {st.st_uid}, not to this process's uid "
            f"{os.geteuid()}; give mptok a directory of its own"
        )
    if st.st_mode & forbidden:
        raise PermissionError(
            f"{what} {path} has mode {stat.S_IMODE(st.st_mode):04o}: group and others must {rule.format(path=path)}"
        )
    return path


def open_private_file(path: str, flags: int) -> int:
    """Open (or create, mode 0600) a regular file of this user at ``path``, never through a link;
    ``PermissionError`` for a link or a file that is not this user's alone to write: following it
    would make mptok read or write wherever it points, or trust what others could have written."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise PermissionError(f"{path} is a symbolic link; mptok refuses to follow it") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        os.close(fd)
        raise PermissionError(
            f"{path} is not a regular file of uid {os.geteuid()} that only it may write "
            f"(mode {stat.S_IMODE(st.st_mode):04o}); mptok refuses to use it"
        )
    return fd


def replace_private_file(path: str, data: bytes) -> None:
    """Write ``data`` as the file at ``path`` (mode 0600), atomically: a
    reader sees it whole, before or after; of racing writers the last
    rename wins. Raises ``OSError``.
    """
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


# Held by the process that made a server's directory, or shared by all that
# use it; a directory without one was not made by mptok and is never swept.
SERVER_LOCK = "supervisor.lock"
_LOCK_SUFFIX = ".lock"


def remove_if_unused(path: str) -> bool:
    """Remove ``path`` if it is this user's real directory (not a link),
    holds ``SERVER_LOCK``, and none of its locks is held (the server's taken
    first, so that no other sweep removes it meanwhile); True if removed.
    Raises ``OSError`` for a directory it cannot read."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        return False
    dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    held: list[int] = []
    try:
        if os.fstat(dir_fd).st_ino != st.st_ino:
            return False
        lock_names = [n for n in os.listdir(dir_fd) if n.endswith(_LOCK_SUFFIX)]
        if SERVER_LOCK not in lock_names:
            return False
        for name in [SERVER_LOCK, *(n for n in lock_names if n != SERVER_LOCK)]:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
            held.append(fd)
            if not try_lock(fd):
                return False
        shutil.rmtree(path)
        return True
    finally:
        for fd in held:
            os.close(fd)
        os.close(dir_fd)


def sweep_unused(parent: str, prefix: str, keep: str | None = None) -> list[str]:
    """Remove this user's directories in ``parent`` whose names start with
    ``prefix`` and that nothing uses (``remove_if_unused``), except ``keep``;
    returns what was removed, and never raises (what it cannot judge is left)."""
    removed: list[str] = []
    try:
        names = [n for n in os.listdir(parent) if n.startswith(prefix)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(parent, name)
        if path == keep:
            continue
        with contextlib.suppress(OSError):
            if remove_if_unused(path):
                removed.append(path)
    return removed
