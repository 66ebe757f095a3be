"""The Spark engine's driver around Spark itself: start a SparkContext (a local master's JVM with the class-data
archive of this Java and Spark, :class:`ClassArchive`), boot it in a thread while the driver does its own checks
(:class:`Boot`), run the first input splits in a forked helper while Spark starts (:class:`HeadStart`, local
masters only), and stop it without PySpark's idle wait (:func:`stop_context`).

Why a head start: on this project's 2-core VM a local master's JVM boots in about 2 s at about 1.2 cores, and
Spark's Python daemon then needs about 1 s at one core before its workers run; the local engine's workers run
after about 1.5 s.  A fork of the driver loads the steps' models (which also stands for the driver's own check
that they load, :meth:`HeadStart.failed`), then forks the helper, at the lowest priority (so that the JVM's boot
keeps the CPU it can use), which runs the same function as Spark's tasks on the first splits meanwhile; the fork
itself stays as the zygote of Spark's Python daemon (:mod:`naohai.data.spark_zygote`), so the models are loaded
once for the helper and every Spark worker.  Every split is run once: the helper and Spark's tasks claim a split
by creating its claim file (exclusive create, :func:`claim`); a Spark task that finds the helper's claim skips its
split, and the helper stops at the first split Spark has claimed, after the one it is running (the engine cuts
the head of the input into small splits for that).  The helper's results (what those tasks would have returned)
are merged with Spark's by the driver; if it fails, the run fails as if a task had.
"""
from __future__ import annotations

import hashlib
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence

from naohai.cache import cache_dir
from naohai.data.rundir import atomic_write_text
from naohai.errors import UserError
from naohai.runfiles import forget_locks_in_child

NICE = 19           # the helper's niceness: the JVM's boot (which can use more than a core) keeps its CPU
HEAD = b"head"      # a claim file's content: the driver's helper runs the split
SPARK = b"spark"    # a Spark task runs it


PANDAS_NOTE = "PySpark does not yet fully support pandas"   # PySpark 4.x's FutureWarning under pandas 3


def quiet_pyspark() -> None:
    """Hide PySpark's FutureWarning about pandas >= 3: its py4j converters import ``pyspark.testing``, which checks
    pandas' version and warns, on every run; the engine does not use pandas."""
    warnings.filterwarnings("ignore", message=PANDAS_NOTE, category=FutureWarning)


def require_pyspark() -> None:
    quiet_pyspark()
    try:
        import pyspark  # noqa: F401
    except ImportError:
        raise UserError("the Spark engine needs PySpark and a Java runtime: pip install -e \".[spark]\" and a JRE "
                        "(e.g. apt-get install openjdk-17-jre-headless)", where="command line",
                        key="--engine") from None


def spark_context(master: str, conf: Optional[Dict[str, str]] = None):
    """A SparkContext for ``master`` (an existing one is reused): local masters on loopback, no web UI, Unix
    sockets between the executor and its Python workers.

    The engine uses the RDD API only, so no SparkSession: on this project's 2-core VM a SparkContext is up in
    about 2.8 s, a SparkSession in about 4.8 s (its SQL state, and pandas imported on the driver)."""
    require_pyspark()
    from pyspark import SparkConf, SparkContext
    settings = {"spark.app.name": "naohai data clean", "spark.master": master,
                "spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false", "spark.driver.memory": "1g",
                "spark.python.worker.reuse": "true", "spark.python.daemon.module": "naohai.data.spark_daemon"}
    archive = None
    if master.startswith("local"):
        # the driver JVM is the executor too; its JIT limited to the quick compiler (C1): the JVM only moves keys
        # and bytes here, and C2's compiles took 4 of its 10 CPU-seconds at start and 40% of them during a
        # 10 MB clean, on the cores the Python workers need
        options = "-XX:TieredStopAtLevel=1"
        if "spark.driver.extraJavaOptions" not in (conf or {}):
            archive = ClassArchive.of_this_spark(options)
        # the executor talks to its Python workers over Unix sockets: over loopback TCP every task waited about
        # 40 ms on the connection (100 empty tasks: 2.5 s on 2 slots, 0.4 s with Unix sockets, measured)
        settings.update({"spark.python.unix.domain.socket.enabled": "true",
                         "spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1",
                         "spark.driver.extraJavaOptions": " ".join([options] + (archive.options() if archive
                                                                               else []))})
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)      # executors: this interpreter
        os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    settings.update(conf or {})
    sconf = SparkConf()
    for k, v in settings.items():
        sconf.set(k, v)
    launches = SparkContext._gateway is None      # else the JVM of an earlier context runs this one
    try:
        sc = SparkContext.getOrCreate(sconf)
    except Exception as exc:   # no Java, a bad master URL: say so in one paragraph
        first = (str(exc).strip().splitlines() or [""])[0]
        raise UserError(f"Spark did not start ({type(exc).__name__}: {first}); the Spark engine needs a Java "
                        "runtime (JAVA_HOME or java on PATH) and a valid master URL",
                        where="command line", key="--master") from None
    sc.setLogLevel("ERROR")
    if launches:
        sc._naohai_archive = archive if archive is not None and archive.dumping else None
    return sc


def stop_context(sc) -> None:
    """``sc.stop()`` without its idle second: PySpark's stop waits for its accumulator server's request handler,
    which polls the JVM's connection once a second (0.9 of its 1.0 s, measured).  The JVM side is stopped first,
    as PySpark does; the server (a daemon thread) is then told to end and left to notice on its own.  A JVM that
    is to write the class archive (:class:`ClassArchive`) is then ended and waited for, and its archive kept."""
    server = getattr(sc, "_accumulatorServer", None)
    if server is not None:
        sc._accumulatorServer = None
    archive = getattr(sc, "_naohai_archive", None)
    sc.stop()
    if server is not None:
        server.server_shutdown = True
        server.handle_error = lambda request, address: None   # the JVM's connection closing first: not an error
        threading.Thread(target=server.shutdown, name="naohai-spark-accumulators", daemon=True).start()
    if archive is not None:
        from pyspark import SparkContext
        gateway = SparkContext._gateway
        with SparkContext._lock:       # the next SparkContext of this process starts a JVM of its own
            SparkContext._gateway = SparkContext._jvm = None
        gateway.shutdown()
        archive.keep(gateway.proc)


class ClassArchive:
    """The class-data-sharing archive (AppCDS) of a local master's driver JVM, for this Java and Spark: the JVM
    maps Spark's classes from it instead of loading and verifying them from the jars, which took the context's
    start from about 2.8 to 1.6 s on this project's VM.  The first local run of a Java and Spark installation has
    its JVM write the archive when it ends (``-XX:ArchiveClassesAtExit``, Java 13+; Spark 4 needs Java 17): the
    driver ends that JVM after the run and waits for it (about 6 s more, once), then renames the file into place
    with its size beside it.  Later runs use it (``-XX:SharedArchiveFile``) when its size is the recorded one: a
    truncated archive makes Java 17 crash (SIGBUS), a stale one (other jars) is ignored by the JVM.  Archives live
    in ``spark-cds`` of naohai's per-machine cache (:func:`naohai.cache.cache_dir`), about 70 MB each, named after a hash of the Java
    release file, Spark's jars (names, sizes, times) and the JVM options.  No archive is used or written when
    ``--spark-conf spark.driver.extraJavaOptions=...`` is given, when the cache folder cannot be written, or when
    the Java release is unknown."""

    QUIET = "-Xlog:cds*=off"   # the JVM's notes on classes it cannot archive, or on an archive it cannot use

    def __init__(self, path: str):
        self.path = path
        self.dumping = not self.ready()
        self.tmp = f"{path}.{os.getpid()}-{threading.get_ident()}.tmp"

    @classmethod
    def of_this_spark(cls, options: str) -> Optional["ClassArchive"]:
        java_home = _java_home()
        try:
            with open(os.path.join(java_home, "release"), "rb") as fh:
                release = fh.read()
            import pyspark
            jars = os.path.join(os.environ.get("SPARK_HOME") or os.path.dirname(pyspark.__file__), "jars")
            listing = sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(jars))
            folder = os.path.join(cache_dir(), "spark-cds")
            os.makedirs(folder, exist_ok=True)
            for e in os.scandir(folder):    # what JVMs killed while writing an archive left (after an hour)
                if e.name.endswith(".tmp") and time.time() - e.stat().st_mtime > 3600:
                    os.remove(e.path)
        except (OSError, TypeError):
            return None
        if not os.access(folder, os.W_OK):
            return None
        key = hashlib.sha256(repr((release, listing, options)).encode()).hexdigest()[:20]
        return cls(os.path.join(folder, f"spark-{key}.jsa"))

    def ready(self) -> bool:
        try:
            with open(self.path + ".size") as fh:
                return int(fh.read().strip()) == os.path.getsize(self.path)
        except (OSError, ValueError):
            return False

    def options(self) -> List[str]:
        if self.dumping:
            return [f"-XX:ArchiveClassesAtExit={self.tmp}", self.QUIET]
        return [f"-XX:SharedArchiveFile={self.path}", self.QUIET]

    def keep(self, jvm) -> None:
        """End the JVM (it exits when its stdin closes), wait for its archive, keep it when it exited cleanly."""
        try:
            jvm.stdin.close()
            code = jvm.wait(120)
            if code == 0 and os.path.getsize(self.tmp) > 0:
                size = os.path.getsize(self.tmp)
                os.replace(self.tmp, self.path)
                atomic_write_text(self.path + ".size", str(size))
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            if os.path.exists(self.tmp):
                os.remove(self.tmp)


def _java_home() -> Optional[str]:
    """The Java installation spark-submit runs: $JAVA_HOME, else the ``java`` on PATH (links resolved)."""
    if os.environ.get("JAVA_HOME"):
        return os.environ["JAVA_HOME"]
    java = shutil.which("java")
    return os.path.dirname(os.path.dirname(os.path.realpath(java))) if java else None




class Boot:
    """The run's SparkContext, started in a thread (:meth:`start`) so that the JVM boots while the driver does
    its own checks; :meth:`context` waits for it, :meth:`stop` stops it unless it was there before."""

    def __init__(self, master: str, conf: Optional[Dict[str, str]]):
        self.master, self.conf = master, conf
        self.thread: Optional[threading.Thread] = None
        self.sc = self.error = None
        self.had = False

    def start(self) -> None:
        if self.thread is None:
            from pyspark import SparkContext
            self.had = SparkContext._active_spark_context is not None
            self.thread = threading.Thread(target=self._boot, name="naohai-spark-boot", daemon=True)
            self.thread.start()

    def _boot(self) -> None:
        try:
            self.sc = spark_context(self.master, self.conf)
        except BaseException as exc:      # raised in the driver's thread by context()
            self.error = exc

    def context(self):
        self.start()
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.sc

    def stop(self) -> None:
        if self.thread is not None:
            self.thread.join()
            if self.sc is not None and not self.had:
                stop_context(self.sc)


# --------------------------------------------------------------------------- the head start
def claim_path(claims: str, n: int) -> str:
    return os.path.join(claims, f"split-{n:06d}")


def claim(claims: str, n: int, who: bytes) -> bool:
    """Claim split ``n`` for ``who`` (HEAD or SPARK): True when ``who`` is to run it.  The first claim wins; a
    Spark task also runs a split that Spark claimed before (a retried or speculative attempt), never one the
    head start claimed.  (A hard link: the claims folder is on a local master's own disk.)"""
    path = claim_path(claims, n)
    tmp = f"{path}.{who.decode()}-{os.getpid()}-{threading.get_ident()}"
    with open(tmp, "wb") as fh:
        fh.write(who)
    try:
        os.link(tmp, path)          # an exclusive create that brings its content: no claim is ever seen empty
        return True
    except FileExistsError:
        if who == HEAD:
            return False
        with open(path, "rb") as fh:
            return fh.read() != HEAD
    finally:
        os.remove(tmp)


def _zygote(conn, stop_fds: tuple, prepare: Callable[[], None], work: Callable[[Any], List[Any]], claims: str,
            parent: int, socket_path: Optional[str]) -> None:
    """The forked process: ``prepare()``, saying ('prepared', None) or ('failed', text); then it forks the head
    start (:func:`_head_start`, at the lowest priority) and, with ``socket_path``, serves as the zygote of Spark's
    Python daemon (:mod:`naohai.data.spark_zygote`; its socket is bound first, so that a daemon asked for while
    the models load waits for them) until the driver closes its end of the ``stop_fds`` pipe."""
    from naohai.data import spark_zygote
    from naohai.interrupt import die_with_parent
    die_with_parent(signal.SIGTERM, parent)
    stop_fd = stop_fds[0]
    os.close(stop_fds[1])      # the driver's end: only the driver may hold it, or the end never comes
    listener = None
    if socket_path is not None:
        try:
            listener = spark_zygote.listen(socket_path)
        except OSError:        # no zygote: Spark's daemon then loads on its own
            listener = None
    try:
        prepare()
        if listener is not None:
            quiet_pyspark()
            from pyspark import daemon  # noqa: F401  (the daemons forked from here have it)
    except Exception as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("prepared", None))
    head = os.fork()
    if head == 0:
        code = 1
        try:
            if listener is not None:
                listener.close()
            os.close(stop_fd)
            die_with_parent(signal.SIGTERM, os.getppid())
            os.nice(NICE)
            _head_start(conn, work, claims)
            code = 0
        finally:
            os._exit(code)
    conn.close()
    try:
        if listener is not None:
            spark_zygote.serve(listener, stop_fd)
        else:
            while os.read(stop_fd, 1):
                pass
    finally:
        try:
            os.kill(head, signal.SIGTERM)      # ended already, unless the run is being stopped
        except OSError:
            pass
        os.waitpid(head, 0)


def _head_start(conn, work: Callable[[Any], List[Any]], claims: str) -> None:
    """``work(item)`` on the items the driver sends, (split number, ...) tuples, in order, while the head start can
    claim them before Spark does; sends back ('ok', [(split number, work's result)]) or ('error', text)."""
    done: List[tuple] = []
    try:
        items = conn.recv()
        for item in items:
            if not claim(claims, item[0], HEAD):
                break
            done.append((item[0], work(item)))
    except Exception as exc:   # the driver raises it after Spark's stage (the run fails, as if a task had)
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ok", done))


class _Forked:
    """A forked child running ``target()`` (exit code 0 when it returns, 1 when it raises), with the parts of
    multiprocessing.Process's interface that :class:`HeadStart` uses."""

    def __init__(self, target: Callable[[], None], close_in_child: Callable[[], None]):
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        self.pid = os.fork()
        if self.pid == 0:
            code = 1
            try:
                for sig in (signal.SIGINT, signal.SIGTERM):   # not the driver's handlers: a signal ends the child
                    signal.signal(sig, signal.SIG_DFL)
                forget_locks_in_child()                      # the output folder's lock ends with the driver
                close_in_child()
                target()
                code = 0
            except BaseException:     # noqa: BLE001  (what multiprocessing would print)
                traceback.print_exc()
                sys.stderr.flush()
            finally:
                os._exit(code)
        self.exitcode: Optional[int] = None

    def is_alive(self) -> bool:
        if self.exitcode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.exitcode = os.waitstatus_to_exitcode(status)
        return self.exitcode is None

    def join(self, timeout: Optional[float] = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.is_alive() and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.005)

    def terminate(self) -> None:
        if self.is_alive():
            os.kill(self.pid, signal.SIGTERM)


_UNKNOWN = object()


class HeadStart:
    """A forked helper of the driver that runs ``work`` on the first splits while Spark starts (see the module's
    docstring), from a fork that has run ``prepare`` and, given ``zygote`` (a socket path in a folder of this
    user's), forks Spark's Python daemon (:mod:`naohai.data.spark_zygote`).  Fork it before the JVM's boot thread
    starts (:meth:`__init__`), hand it the splits once known (:meth:`begin`), collect what it ran after Spark's
    stage (:meth:`results`); :meth:`end` stops both whatever happened (a daemon already forked lives on: Spark
    stops it)."""

    def __init__(self, prepare: Callable[[], None], work: Callable[[Any], List[Any]], claims: str,
                 zygote: Optional[str] = None):
        os.makedirs(claims, exist_ok=True)
        self.claims = claims
        self.conn, child = multiprocessing.Pipe()
        stop_fd, self.stop = os.pipe()
        # a plain fork: a multiprocessing.Process's "ended" pipe would be held open by the daemons forked from it
        self.proc = _Forked(lambda: _zygote(child, (stop_fd, self.stop), prepare, work, claims, os.getppid(), zygote),
                            close_in_child=self.conn.close)
        child.close()
        os.close(stop_fd)
        self.begun = False
        self.prepare_error: Any = _UNKNOWN

    def begin(self, items: Sequence[tuple]) -> None:
        """``items``: (split number, ...) tuples, in the order to take them."""
        self.begun = True
        try:
            self.conn.send(list(items))
        except OSError:        # the helper has ended (its error is in the pipe): results() raises it
            pass

    def failed(self) -> Optional[str]:
        """Waits until the helper has run ``prepare``: None when it did, else what it raised (as text)."""
        if self.prepare_error is _UNKNOWN:
            try:
                kind, got = self.conn.recv()
            except EOFError:
                kind, got = "failed", self._ended()
            self.prepare_error = got if kind == "failed" else None
        return self.prepare_error

    def results(self) -> Dict[int, Any]:
        """{split number: work's result} of the splits the helper ran; raises what it raised."""
        if not self.begun:
            self.begin([])
        try:
            if self.failed() is not None:
                raise RuntimeError(self.prepare_error)
            try:
                kind, got = self.conn.recv()
            except EOFError:
                raise RuntimeError(self._ended()) from None
        finally:
            self.end()
        if kind == "error":
            raise RuntimeError(got)
        return dict(got)

    def _ended(self) -> str:
        self.proc.join(5)
        return (f"the driver's head start (pid {self.proc.pid}) ended without its results "
                f"(exit code {self.proc.exitcode})")

    def end(self) -> None:
        if self.proc.is_alive() and not self.begun:
            try:
                self.conn.send([])
            except OSError:    # it ended meanwhile: nothing to tell it (end() runs in the engine's finally)
                pass
        if self.stop is not None:
            os.close(self.stop)
            self.stop = None
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join()
        self.conn.close()
