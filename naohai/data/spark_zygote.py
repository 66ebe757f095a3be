"""A local master's zygote: a fork of the driver that has loaded what the Spark engine's Python workers need (the
steps' models, jieba's dictionary, PySpark's daemon module) and forks Spark's Python daemon on request, so that the
daemon starts with all of it instead of importing and loading it again (about 1.5 CPU-seconds on this project's
2-core VM, on the cores the workers need).  The driver's head start is forked from it as well
(:class:`naohai.data.spark_driver.HeadStart`), so the models are loaded once for both.

Spark launches ``python -m naohai.data.spark_daemon``.  With ``ZYGOTE_ENV`` in its environment (the driver puts it
there through ``spark.executorEnv``), that process is a stand-in (:func:`stand_in`): it connects to the zygote's
Unix socket, in a folder only this user can open (the zygote also checks the caller's uid), and hands over its
standard input, output and error, its arguments, environment and working folder.  The zygote forks the daemon,
which takes them over and runs PySpark's ``daemon.manager()`` (:func:`serve`).  The stand-in then waits for the
daemon to end, passing on the SIGTERM with which Spark stops its daemon.  When the zygote cannot be reached (it has
ended, or failed to load the models), the stand-in returns and the daemon module starts a daemon of its own.
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import sys
import traceback
from typing import Any, Dict, List, Optional

ZYGOTE_ENV = "NAOHAI_SPARK_ZYGOTE"   # the zygote's socket path, in the Python workers' environment
_LENGTH = struct.Struct("!I")
_PID = struct.Struct("!i")
_CREDENTIALS = struct.Struct("3i")   # SO_PEERCRED: pid, uid, gid


def _exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        got = sock.recv(n - len(data))
        if not got:
            raise ConnectionError("the peer closed the connection")
        data += got
    return data


def stand_in(path: str) -> Optional[int]:
    """In the process Spark started as its Python daemon: have the zygote at ``path`` fork the daemon with this
    process's standard streams, arguments, environment and working folder, then wait for that daemon to end.
    Returns 0 once it has ended, or None (having done nothing) when the zygote cannot be reached."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        payload = json.dumps({"argv": sys.argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
        socket.send_fds(sock, [_LENGTH.pack(len(payload))], [0, 1, 2])
        sock.sendall(payload)
        pid = _PID.unpack(_exactly(sock, _PID.size))[0]
    except OSError:
        sock.close()
        return None
    signal.signal(signal.SIGTERM, lambda *_: _forward(pid))   # how Spark stops its daemon
    while sock.recv(4096):      # the daemon (and its workers) hold the other end until they end
        pass
    return 0


def _forward(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except OSError:
        pass


def listen(path: str) -> socket.socket:
    """The zygote's socket at ``path`` (its folder made by the driver, mode 0700)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    return listener


def serve(listener: socket.socket, stop_fd: int) -> None:
    """The zygote's loop: fork a daemon for each stand-in that connects, until ``stop_fd`` reads end-of-file."""
    children: List[int] = []
    while True:
        ready, _, _ = select.select([listener, stop_fd], [], [])
        children = [pid for pid in children if not _reaped(pid)]
        if stop_fd in ready:
            return
        conn, _ = listener.accept()
        fds: List[int] = []
        try:
            _, uid, _ = _CREDENTIALS.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                            _CREDENTIALS.size))
            head, fds, _, _ = socket.recv_fds(conn, _LENGTH.size, 3)
            if uid != os.getuid() or len(head) != _LENGTH.size or len(fds) != 3:
                raise ValueError("not a stand-in of this user")
            request = json.loads(_exactly(conn, _LENGTH.unpack(head)[0]))
        except (OSError, ValueError):
            for fd in fds:
                os.close(fd)
            conn.close()
            continue
        for stream in (sys.stdout, sys.stderr):   # nothing of the driver's may reach Spark's pipes
            stream.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                listener.close()
                os.close(stop_fd)
                code = _daemon(conn, fds, request)
            except BaseException:     # noqa: BLE001  (to the stand-in's stderr: Spark's log shows it)
                traceback.print_exc()
                sys.stderr.flush()
            finally:
                os._exit(code)
        children.append(pid)
        for fd in fds:
            os.close(fd)
        try:
            conn.sendall(_PID.pack(pid))
        except OSError:
            pass
        conn.close()


def _reaped(pid: int) -> bool:
    try:
        return os.waitpid(pid, os.WNOHANG)[0] != 0
    except ChildProcessError:
        return True


_HELD: List[Any] = []    # the daemon's connection to its stand-in, open for as long as the daemon lives


def _daemon(conn: socket.socket, fds: List[int], request: Dict[str, Any]) -> int:
    """In the forked daemon: take over the stand-in's streams, arguments, environment and folder, and run PySpark's
    daemon (it ends by SystemExit); returns its exit code."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    _HELD.append(conn)
    # the driver's streams may be anything (a test runner's capture): the daemon's are the stand-in's descriptors
    sys.stdin = open(0, "r", closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv[:] = request["argv"]
    os.chdir(request["cwd"])
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    from pyspark import daemon
    try:
        daemon.manager()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    return 0
