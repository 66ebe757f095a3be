"""Stopping on a signal, one design for SIGTERM (schedulers, ModelArts, ``kill``) and SIGINT (Ctrl-C).

A :class:`StopRequest` records the first stop signal.  The training loop checks it between
steps (all ranks agree on it), writes one final checkpoint (under SIGTERM only when the
last save's duration fits in the grace time ``NAOHAI_STOP_GRACE``, default 25 s: the
scheduler's SIGKILL follows) and raises :class:`Interrupted`, which the CLI prints as one
line naming the step the run resumes from, exiting 128 + the signal (130 for SIGINT, 143
for SIGTERM).  A signal before the loop (data preparation, compile) or a second signal
stops at once: nothing is half-written (checkpoints are published atomically) and the
kernel drops the run folder's lock.

How signals reach the request.  MindSpore 2.10 installs its own SIGINT handler around
every graph run (``SignalGuard`` in its graph scheduler) that sends SIGTERM to its own
process, so a Python SIGINT handler never sees a Ctrl-C during a step.  ``naohai train``
therefore blocks SIGINT and SIGTERM before MindSpore is imported (:func:`block_stop_signals`;
every thread started later inherits the mask) and a watcher thread takes them with
``sigwaitinfo``.  A SIGTERM the process sent itself is MindSpore ending a rank whose cluster
failed (a peer died, a collective timed out): no checkpoint can be agreed on then, and the
process exits 1 (not 143) after its main thread had 10 s to report the error.  Where the signals are not blocked (naohai used as a
library), Python handlers are installed instead and re-armed after every step.

:func:`die_with_parent` asks the kernel to send SIGTERM to this process when its parent
dies (``prctl(PR_SET_PDEATHSIG)``, Linux): worker processes of ``data clean`` / ``score``,
msrun under ``naohai launch`` and msrun's workers end with their parent.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Callable, Optional

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: seconds a stop at the main thread may take before the process exits without it
HARD_EXIT_AFTER_S = 10.0


def signal_name(signum: int) -> str:
    return {signal.SIGINT: "SIGINT (Ctrl-C)", signal.SIGTERM: "SIGTERM"}.get(signum, f"signal {signum}")


class Interrupted(Exception):
    """The run stopped on a signal; ``str()`` says what was saved and where it resumes."""

    def __init__(self, signum: int, message: str):
        self.signum = signum
        self.exit_code = 128 + int(signum)
        super().__init__(message)


def _unblock() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


_AT_FORK = []


def block_stop_signals() -> None:
    """Block SIGINT and SIGTERM in this thread (and every thread and forked child started later;
    forked Python children unblock them again) so that only :meth:`StopRequest.watch` takes them.
    Call before MindSpore is imported."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    if not _AT_FORK:
        os.register_at_fork(after_in_child=_unblock)
        _AT_FORK.append(True)


def stop_signals_blocked() -> bool:
    return set(STOP_SIGNALS) <= set(signal.pthread_sigmask(signal.SIG_BLOCK, []))


def die_with_parent(sig: int = signal.SIGTERM, parent: Optional[int] = None) -> None:
    """Have the kernel send ``sig`` to this process when its parent ends (Linux; no-op elsewhere).
    ``parent``: the pid the caller expects as parent; if it is already gone, ``sig`` is sent now."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(sig), 0, 0, 0)          # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        return
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)


class StopRequest:
    """The first stop signal of this process (see the module docstring)."""

    def __init__(self, log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr, flush=True)):
        self.signum: Optional[int] = None
        self.at: Optional[float] = None
        self.deferring = False            # True while the loop can stop between steps
        self.log = log
        self._watcher: Optional[threading.Thread] = None
        self._python_handlers = False
        self._previous: dict = {}

    # ---- receiving
    def watch(self) -> "StopRequest":
        """Start taking the stop signals: a ``sigwaitinfo`` thread if they are blocked, else Python handlers
        (main thread only; :meth:`rearm` after every MindSpore graph run)."""
        if stop_signals_blocked():
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._wait_loop, name="naohai-stop-signals", daemon=True)
                self._watcher.start()
        elif threading.current_thread() is threading.main_thread():
            self._python_handlers = True
            self.rearm()
        return self

    def rearm(self) -> None:
        """Re-install the Python handlers (MindSpore replaces the SIGINT one around each graph run)."""
        if self._python_handlers:
            for sig in STOP_SIGNALS:
                previous = signal.signal(sig, self._python_handler)
                if sig not in self._previous:
                    self._previous[sig] = previous

    def release(self) -> None:
        """Give the Python handlers :meth:`watch` installed back (SIGINT: Python's KeyboardInterrupt)."""
        if self._python_handlers:
            for sig in STOP_SIGNALS:
                old = self._previous.get(sig)
                signal.signal(sig, old if callable(old) or old in (signal.SIG_DFL, signal.SIG_IGN) else
                              (signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL))
            self._python_handlers = False
            self._previous = {}
            self.signum = self.at = None       # naohai as a library: the next run starts unstopped

    def _wait_loop(self) -> None:
        while True:
            info = signal.sigwaitinfo(STOP_SIGNALS)
            if info.si_signo == signal.SIGTERM and info.si_pid == os.getpid():
                self._mindspore_ended_us()
                continue
            self._receive(info.si_signo, in_main=False)

    def _mindspore_ended_us(self) -> None:
        """A SIGTERM this process sent itself: MindSpore's cluster code ends a rank this way when a peer
        or a collective failed ("Callback on exception is called. Kill this process with SIGTERM").
        No checkpoint can be agreed on any more: give the main thread its error, then exit 1."""
        self.log("naohai: MindSpore ended this process (its cluster reported a failure: a rank died or a "
                 "collective timed out; see the lines above); no final checkpoint")
        timer = threading.Timer(HARD_EXIT_AFTER_S, lambda: os._exit(1))
        timer.daemon = True
        timer.start()

    def _python_handler(self, signum, _frame) -> None:
        self._receive(signum, in_main=True)

    def _receive(self, signum: int, in_main: bool) -> None:
        if self.signum is None and self.deferring:
            self.signum, self.at = signum, time.time()
            self.log(f"naohai: {signal_name(signum)} received; stopping after this step")
            return
        first = self.signum is None
        self.signum = self.signum or signum
        self.at = self.at or time.time()
        self.log(f"naohai: {signal_name(signum)} received; stopping now" + ("" if first else " (second signal)"))
        if in_main:
            raise Interrupted(self.signum, self.stopped_now_message())
        import _thread
        _thread.interrupt_main()
        # the main thread may be inside MindSpore (compile, a collective) for long: exit regardless
        timer = threading.Timer(HARD_EXIT_AFTER_S, self._hard_exit)
        timer.daemon = True
        timer.start()

    def _hard_exit(self) -> None:
        self.log(f"naohai: {self.stopped_now_message()} (the main thread did not stop within "
                 f"{HARD_EXIT_AFTER_S:.0f} s)")
        os._exit(128 + int(self.signum or signal.SIGTERM))

    # ---- asking
    @property
    def requested(self) -> bool:
        return self.signum is not None

    def seconds_left(self, grace: float) -> float:
        """Of the grace time after the signal (SIGTERM); unbounded for SIGINT."""
        if self.signum != signal.SIGTERM or self.at is None:
            return float("inf")
        return grace - (time.time() - self.at)

    def stopped_now_message(self) -> str:
        return f"stopped by {signal_name(self.signum or signal.SIGTERM)}; nothing was saved by this stop"


#: the process's request (one per process: signals are per process)
_CURRENT: Optional[StopRequest] = None


def current() -> StopRequest:
    global _CURRENT
    if _CURRENT is None:
        _CURRENT = StopRequest()
    return _CURRENT


def grace_seconds() -> float:
    """``NAOHAI_STOP_GRACE``: seconds between SIGTERM and the scheduler's SIGKILL (default 25)."""
    from naohai.validate import number
    raw = os.environ.get("NAOHAI_STOP_GRACE")
    if raw is None or raw == "":
        return 25.0
    try:
        value = float(raw)
    except ValueError:
        value = raw
    return float(number(value, "environment", "NAOHAI_STOP_GRACE", minimum=0.0, maximum=86400.0))
