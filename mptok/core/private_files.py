"""The private ipc directory and the files in it: this user's, and never reached through a link.

Every frontend of one server shares a directory: the owners' sockets and
their lock files (``mptok.transport``), the owners' records
(``mptok.routing.liveness``), the metrics snapshots (``mptok.serve``).
With the authkey, the directory's permissions are what keep other users
away from all of it, so every layer that opens something there opens it
through here. Core, the bottom layer, so that each of them can.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat


def secure_ipc_dir(path: str) -> str:
    """Create ``path`` (mode 0700) if missing and check that only this user can enter it.

    Raises ``PermissionError`` if ``path`` is a symbolic link (its target is
    whatever the link says today, not a directory this user made), if
    another user owns it, or if group or others have any access to it;
    ``NotADirectoryError`` if it is not a directory. The checks are made on
    the opened directory itself, so a path swapped between the check and
    the open cannot pass. Returns the absolute path.
    """
    path = os.path.abspath(path)
    with contextlib.suppress(FileExistsError):
        os.makedirs(path, mode=0o700)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if os.path.islink(path):
            raise PermissionError(f"ipc dir {path} is a symbolic link; give mptok a real directory") from None
        if e.errno == errno.ENOTDIR:
            raise NotADirectoryError(f"ipc dir {path} is not a directory") from None
        raise
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if st.st_uid != os.geteuid():
        raise PermissionError(
            f"ipc dir {path} belongs to uid {st.st_uid}, not to this process's uid "
            f"{os.geteuid()}; give mptok a directory of its own"
        )
    if st.st_mode & 0o077:
        raise PermissionError(
            f"ipc dir {path} has mode {stat.S_IMODE(st.st_mode):04o}: group and others "
            f"must have no access to it (chmod 700 {path})"
        )
    return path


def open_private_file(path: str, flags: int) -> int:
    """Open (or create, mode 0600) a regular file of this user at ``path``, never through a link.

    Raises ``PermissionError`` if ``path`` is a symbolic link, anything but
    a regular file of this user, or a file that group or others may write:
    in the private ipc dir only a bug or another program of this user puts
    one there, and following it would make mptok read or write wherever it
    points, or trust what others could have written. ``FileNotFoundError``
    as ``os.open`` raises it.
    """
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
