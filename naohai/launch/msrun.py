"""Building, running and diagnosing one node's ``msrun`` command.

This module owns the msrun side of launching: :class:`MsrunPlan` holds what one
node needs, :func:`build_msrun_command` checks it and turns it into an argv,
:func:`run_msrun` prints and runs that argv and, when the job fails, names the
rank(s) that died from msrun's output and the per-rank logs.

How msrun 2.10 behaves (read in its source and measured on CPU, see
tests/launch/test_msrun_failure.py):

* the task script is run as ``python SCRIPT ARGS``; only the literal names
  ``python``/``python3``/``pytest`` are accepted as an interpreter, so the entry is
  ``python -m naohai.cli train RECIPE [overrides] --strategy FILE`` (``python`` must be on
  PATH on every node).  The scheduler process on the master node runs the same
  command with ``MS_ROLE=MS_SCHED``: the trainer must call
  ``mindspore.communication.init()`` before doing real work.
* without ``--join True`` msrun returns 0 as soon as the workers are spawned, so
  failures can only be diagnosed with join (our default).
* with join, when a worker exits non-zero (or is SIGKILLed) msrun logs ``Worker
  process PID exit with exception. Error code: N`` within ~1 s, SIGKILLs the other
  local workers, waits for the scheduler and exits 1.  The scheduler notices dead
  ranks by heartbeat after ``MS_NODE_TIMEOUT`` seconds (default 30; measured 32 s
  from death to msrun's exit with cluster_time_out 10 and 30, 6.5 s with
  MS_NODE_TIMEOUT=5), not after ``cluster_time_out``, which only bounds how long
  the cluster may take to form.  ``node_time_out`` sets MS_NODE_TIMEOUT.  On CPU MindSpore
  also takes MS_NODE_TIMEOUT as the wait of every collective (``collective_ops_impl``: "Broadcast
  wait receiving ... failed"), so a host barrier that one rank reaches more than that many
  seconds before another fails: with 5 s, the barrier after compiling failed under load.

Rank-table fallback: some sites still start jobs the pre-msrun way, one process
per device with ``RANK_TABLE_FILE``, ``RANK_ID``, ``DEVICE_ID`` and ``RANK_SIZE``
in its environment (HCCL builds the communicator from the table).  With
``rank_table_file`` set and ``rank_table_mode="processes"`` the plan produces one
command + environment per local device instead of one msrun command
(:func:`build_rank_table_processes`).  With the default mode ``"msrun"`` the table
is only passed to msrun as ``--rank_table_file`` (msrun exports it for features
that need it but still builds the cluster dynamically).
"""
from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, TextIO, Tuple

from naohai.errors import UserError
from naohai.validate import INT_MAX, MAX_DEVICES

WHERE = "launch"
DEFAULT_PORT = 8118          # msrun's own default
PORT_MIN, PORT_MAX = 1024, 65535   # msrun documents 1024..65535 for --master_port
LOG_NAME = "worker"          # msrun's default --worker_log_name -> worker_<rank>.log


@dataclass
class MsrunPlan:
    """What one node needs to take part in a job: sizes, rendezvous, logs, entry."""

    recipe: str
    strategy: Optional[str]
    workers: int                       # total worker processes in the job
    nodes: int = 1
    node_rank: int = 0
    local_workers: Optional[int] = None  # default workers // nodes
    master_addr: Optional[str] = None    # required when nodes > 1
    master_port: int = DEFAULT_PORT
    log_dir: str = "runs/msrun_logs"    # naohai launch passes <train.output_dir>/msrun_logs
    join: bool = True
    cluster_time_out: int = 600
    bind_core: bool = False
    rank_table_file: Optional[str] = None
    rank_table_mode: str = "msrun"       # msrun | processes
    overrides: List[str] = field(default_factory=list)
    python: str = "python"
    node_time_out: Optional[int] = None  # MS_NODE_TIMEOUT: seconds before a silent rank is declared dead
    entry: Optional[List[str]] = None    # replaces "-m naohai.cli train ..." (tests, tools)
    device: Optional[str] = None         # passed to the workers as --device

    @property
    def per_node(self) -> int:
        return self.local_workers if self.local_workers is not None else self.workers // max(1, self.nodes)

    def ranks(self) -> List[int]:
        """Global ranks started on this node (msrun's node_rank * local + i rule)."""
        return [self.node_rank * self.per_node + i for i in range(self.per_node)]


def _as_int(value, key: str, rule: str) -> int:
    if isinstance(value, bool):
        raise UserError(f"must be an integer, got {value!r}", where=WHERE, key=key, rule=rule)
    try:
        return int(str(value).strip(), 10)
    except (TypeError, ValueError):
        raise UserError(f"must be an integer, got {value!r}", where=WHERE, key=key, rule=rule) from None


def validate_plan(plan: MsrunPlan) -> MsrunPlan:
    """Check every field; return a copy with ints normalised.  Raises UserError."""
    workers = _as_int(plan.workers, "workers", "a positive number of worker processes")
    nodes = _as_int(plan.nodes, "nodes", "nodes >= 1")
    node_rank = _as_int(plan.node_rank, "node_rank", "0 <= node_rank < nodes")
    port = _as_int(plan.master_port, "master_port", f"an integer port in {PORT_MIN}..{PORT_MAX}")
    timeout = _as_int(plan.cluster_time_out, "cluster_time_out", "seconds; negative waits forever")
    node_timeout = None
    if plan.node_time_out is not None:
        node_timeout = _as_int(plan.node_time_out, "node_time_out", "seconds >= 1")
        if node_timeout < 1:
            raise UserError(f"must be at least 1 second, got {node_timeout}", where=WHERE,
                            key="node_time_out", rule="seconds >= 1")
    if timeout == 0 or timeout > INT_MAX:
        raise UserError(f"must be a number of seconds from 1 to {INT_MAX} (or negative: wait forever), got "
                        f"{timeout}" + (" (the cluster would time out at once)" if timeout == 0 else ""),
                        where=WHERE, key="cluster_time_out", rule=f"1 <= seconds <= {INT_MAX}, or negative")
    if node_timeout is not None and node_timeout > INT_MAX:
        raise UserError(f"must be at most {INT_MAX} seconds, got {node_timeout}", where=WHERE, key="node_time_out",
                        rule=f"1 <= seconds <= {INT_MAX}")
    if not 1 <= workers <= MAX_DEVICES:
        raise UserError(f"must be 1 to {MAX_DEVICES:,}, got {workers}", where=WHERE, key="workers",
                        rule="a positive number of worker processes")
    if nodes < 1:
        raise UserError(f"must be at least 1, got {nodes}", where=WHERE, key="nodes", rule="nodes >= 1")
    if not 0 <= node_rank < nodes:
        raise UserError(f"node rank {node_rank} is out of range for {nodes} node(s)", where=WHERE,
                        key="node_rank", rule="0 <= node_rank < nodes")
    if workers % nodes:
        raise UserError(f"{workers} workers cannot be spread evenly over {nodes} nodes", where=WHERE,
                        key="workers", rule="workers divisible by nodes (msrun gives every node the same count)")
    if not PORT_MIN <= port <= PORT_MAX:
        raise UserError(f"port {port} is outside {PORT_MIN}..{PORT_MAX}", where=WHERE, key="master_port",
                        rule=f"an integer port in {PORT_MIN}..{PORT_MAX}")
    local = workers // nodes
    if plan.local_workers is not None:
        given = _as_int(plan.local_workers, "local_workers", "workers / nodes")
        if given != local:
            raise UserError(f"{given} local workers does not match {workers} workers over {nodes} node(s) "
                            f"(expected {local})", where=WHERE, key="local_workers", rule="workers / nodes")
    addr = (plan.master_addr or "").strip() or None
    if nodes > 1 and not addr:
        raise UserError(f"a master address is required for a {nodes}-node job (the IP or host name of "
                        "node 0, the same on every node)", where=WHERE, key="master_addr",
                        rule="required when nodes > 1")
    if addr and not _looks_like_host(addr):
        raise UserError(f"'{addr}' is not an IP address or host name", where=WHERE, key="master_addr")
    if not plan.recipe and not plan.entry:
        raise UserError("a recipe is required", where=WHERE, key="recipe")
    if plan.rank_table_mode not in ("msrun", "processes"):
        raise UserError(f"unknown rank table mode '{plan.rank_table_mode}'", where=WHERE,
                        key="rank_table_mode", rule="msrun | processes")
    if plan.rank_table_mode == "processes" and not plan.rank_table_file:
        raise UserError("rank table mode 'processes' needs a rank table file", where=WHERE,
                        key="rank_table_file")
    return dataclasses.replace(plan, workers=workers, nodes=nodes, node_rank=node_rank, master_port=port,
                               cluster_time_out=timeout, local_workers=local, node_time_out=node_timeout,
                               master_addr=addr or "127.0.0.1", overrides=list(plan.overrides))


_HOST_RE = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                      r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")


def _looks_like_host(addr: str) -> bool:
    try:
        ipaddress.ip_address(addr.strip("[]"))
        return True
    except ValueError:
        return bool(_HOST_RE.match(addr))


def _listener(port: int) -> Optional[str]:
    """``pid N (command)`` of the process listening on TCP ``port`` on this machine, from /proc; None
    when it cannot be seen (another user's process, no /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, "r", encoding="ascii") as fh:
                rows = fh.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{cols[9]}]")
    for pid in filter(str.isdigit, os.listdir("/proc") if inodes else ()):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in fds):
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    command = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
                return f"pid {pid} ({command[:120]})"
        except OSError:
            continue
    return None


def scheduler_port(addr: str, port: Optional[int], *, nodes: int) -> int:
    """The port node 0's msrun scheduler listens on at ``addr``.

    ``port`` None on one node: a free port the kernel hands out (its ephemeral range, 32768 up on Linux),
    not msrun's default 8118 -- MindSpore's worker processes listen from 8118 up whatever the scheduler's
    port (2.10 on CPU, measured: 8118 and 8374 with the scheduler on 40123), so a scheduler there races
    the workers of any other job starting on the machine.  When another process takes the port between a
    check and msrun's bind, the scheduler cannot listen and the workers wait out the cluster time-out
    (``Failed to initialize distributed job cluster``: seen in CI, the README's launch beside other tests'
    msrun jobs, and reproduced by holding the port; :func:`failure_report` names it).

    A port given (or 8118 for several nodes, which must agree on it) is checked: in use on this machine
    -> a :class:`UserError` naming the holder, before any worker starts.  An address that is not this
    machine's is not checked (node 0 is elsewhere)."""
    import errno
    import socket
    family, host = (socket.AF_INET6 if ":" in addr else socket.AF_INET), addr.strip("[]")
    try:
        socket.getaddrinfo(host, None, family)
    except (socket.gaierror, UnicodeError) as exc:       # msrun here could not reach node 0 either
        raise UserError(f"'{addr}' does not resolve on this machine ({exc}); give node 0's address as every "
                        f"node reaches it", where=WHERE, key="master_addr", rule="an address that resolves") from None
    if port is None and nodes == 1:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, 0))
            except OSError as exc:
                raise UserError(f"'{addr}' is not an address of this machine ({exc.strerror or exc}); with one node "
                                f"msrun's scheduler runs here, so leave --master-addr out (127.0.0.1) or give one "
                                f"of this machine's addresses", where=WHERE, key="master_addr",
                                rule="one node: an address of this machine") from None
            return probe.getsockname()[1]
    port = DEFAULT_PORT if port is None else port
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as a listening server binds
        try:
            probe.bind((host, port))
            return port
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                return port                      # not an address of this machine: node 0 is elsewhere
    holder = _listener(port) or "another process"
    raise UserError(f"port {port} on {addr} is in use by {holder}; msrun's scheduler could not listen there "
                    f"(MindSpore's workers listen from {DEFAULT_PORT} up, so another job's may hold it). "
                    "Choose another port, the same on every node", where=WHERE, key="master_port",
                    rule="a port free on node 0")


def entry_args(plan: MsrunPlan) -> List[str]:
    """The arguments after ``python``: ``-m naohai.cli train RECIPE [overrides] --strategy FILE --device D``.

    Overrides come right after the recipe: plain argparse (as `naohai train` uses)
    does not accept positionals after an option.
    """
    if plan.entry:
        return list(plan.entry)
    args = ["-m", "naohai.cli", "train", plan.recipe] + list(plan.overrides)
    if plan.strategy:
        args += ["--strategy", plan.strategy]
    if plan.device:
        args += ["--device", plan.device]
    return args


def build_msrun_command(plan: MsrunPlan) -> List[str]:
    """Validate ``plan`` and return this node's msrun argv."""
    p = validate_plan(plan)
    cmd = ["msrun",
           "--worker_num", str(p.workers),
           "--local_worker_num", str(p.local_workers),
           "--master_addr", p.master_addr,
           "--master_port", str(p.master_port),
           "--node_rank", str(p.node_rank),
           "--log_dir", p.log_dir,
           "--join", "True" if p.join else "False",
           "--cluster_time_out", str(p.cluster_time_out)]
    if p.bind_core:
        cmd += ["--bind_core", "True"]
    if p.rank_table_file:
        cmd += ["--rank_table_file", p.rank_table_file]
    return cmd + [p.python] + entry_args(p)


def build_rank_table_processes(plan: MsrunPlan) -> List[Tuple[List[str], Dict[str, str]]]:
    """Rank-table fallback: one (argv, extra env) per local device, no msrun."""
    p = validate_plan(plan)
    if not p.rank_table_file:
        raise UserError("the rank-table launch needs a rank table file", where=WHERE, key="rank_table_file")
    out = []
    for device, rank in enumerate(p.ranks()):
        env = {**launch_env(p), "RANK_TABLE_FILE": p.rank_table_file, "RANK_ID": str(rank), "DEVICE_ID": str(device),
               "RANK_SIZE": str(p.workers)}
        out.append(([p.python] + entry_args(p), env))
    return out


def launch_env(plan: MsrunPlan) -> Dict[str, str]:
    """Extra environment for msrun (set before the command, printed with it)."""
    env = {}
    if plan.node_time_out is not None:
        env["MS_NODE_TIMEOUT"] = str(plan.node_time_out)
    return env


def quote(argv: Sequence[str], env: Optional[Dict[str, str]] = None) -> str:
    """Shell form of ``argv``, prefixed by ``K=V`` assignments of ``env``."""
    pre = [f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()]
    return " ".join(pre + [shlex.quote(a) for a in argv])


# --------------------------------------------------------------------------- diagnosis
_DEAD_RE = re.compile(r"Worker process (\d+) exit with exception\. Error code: (-?\d+)")
_PID_RE = re.compile(r"^\[[A-Z]+\] [A-Z_]+\((\d+),", re.M)
_ERR_RE = re.compile(r"Traceback \(most recent call last\)|^\w*Error\b|\[ERROR\]|\[CRITICAL\]", re.M)


def worker_logs(log_dir: str, log_name: str = LOG_NAME) -> Dict[int, str]:
    """rank -> path of msrun's per-rank log files ``<log_dir>/<log_name>_<rank>.log``."""
    found = {}
    if not os.path.isdir(log_dir):
        return found
    pat = re.compile(re.escape(log_name) + r"_(\d+)\.log$")
    for name in os.listdir(log_dir):
        m = pat.match(name)
        if m:
            found[int(m.group(1))] = os.path.join(log_dir, name)
    return dict(sorted(found.items()))


def _read(path: str) -> str:
    try:
        with open(path, "r", encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""


def tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.rstrip("\n").splitlines()[-lines:])


def diagnose(log_dir: str, msrun_output: str = "", log_name: str = LOG_NAME) -> List[Tuple[int, str, str]]:
    """Ranks that died: ``[(rank, reason, log tail)]``.

    First choice: the PIDs msrun reported as exiting with an error, mapped to ranks
    through the PID MindSpore writes in every log line.  Otherwise: the ranks whose
    logs hold a traceback or an ERROR line (a rank killed before it logged anything
    is invisible to this second rule).
    """
    logs = worker_logs(log_dir, log_name)
    texts = {rank: _read(path) for rank, path in logs.items()}
    pid_rank = {}
    for rank, text in texts.items():
        for pid in set(_PID_RE.findall(text)):
            pid_rank[pid] = rank
    dead = []
    for pid, code in _DEAD_RE.findall(msrun_output):
        rank = pid_rank.get(pid)
        if rank is not None and all(d[0] != rank for d in dead):
            dead.append((rank, _describe_code(int(code)), tail(texts[rank])))
    if dead:
        return dead
    for rank, text in texts.items():
        if _ERR_RE.search(text):
            dead.append((rank, "its log holds an error", tail(text)))
    return dead


def _describe_code(code: int) -> str:
    if code < 0:
        try:
            import signal
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


SCHEDULER_LOG = "scheduler.log"   # msrun's scheduler (MindSpore's meta server node) logs here
#: MindSpore's line when the scheduler's port is taken: ``Failed to call bind, url: 127.0.0.1:8118 Address ...``
_SCHED_BIND_RE = re.compile(r"Failed to call bind, url: (\S+) Address already in use")
#: MindSpore's error in every worker when the cluster does not form within msrun's --cluster_time_out
_NO_CLUSTER = "Failed to initialize distributed job cluster"


def failure_report(log_dir: str, msrun_output: str, code: int, log_name: str = LOG_NAME,
                   dead: Optional[List[Tuple[int, str, str]]] = None) -> str:
    """The paragraph printed after a failed job: dead ranks, why, and their log tails."""
    if dead is None:
        dead = diagnose(log_dir, msrun_output, log_name)
    head = f"naohai launch: msrun exited with code {code}."
    busy = _SCHED_BIND_RE.search(_read(os.path.join(log_dir, SCHEDULER_LOG)))
    if busy:
        head += (f" msrun's scheduler could not listen on {busy.group(1)}: another process took the port "
                 "first, so the workers waited for a scheduler that never came (see --master-port).")
    elif any(_NO_CLUSTER in text for _, _, text in dead):
        head += (" The cluster did not form within --cluster-time-out: a worker that never started or died "
                 "first (see msrun.log), a scheduler another node could not reach, or nodes given different "
                 "--master-addr / --master-port / --nodes.")
    if not dead:
        return head + f" No failing rank could be identified; see the logs in {log_dir}."
    parts = [head + " Dead rank(s): " + ", ".join(str(r) for r, _, _ in dead) + "."]
    for rank, reason, text in dead:
        path = os.path.join(log_dir, f"{log_name}_{rank}.log")
        parts.append(f"--- rank {rank} {reason}; last lines of {path}:\n{text}")
    return "\n".join(parts)


#: a line of MindSpore's own logger: ``[WARNING] ME(1234,7f..,python):2026-... [file:line] func] text``
_MS_LOG_RE = re.compile(r"^\[(DEBUG|INFO|WARNING|ERROR|CRITICAL|EXCEPTION)\] [A-Z_]+\(\d+")
MSRUN_LOG = "msrun.log"      # msrun's own console output, kept next to the worker logs


class WorkerLogFollower:
    """Reads the per-rank logs as they grow and passes on the lines naohai's code wrote (its progress
    lines, tracebacks, anything that is not MindSpore's logger), each prefixed with its rank."""

    def __init__(self, log_dir: str, write, log_name: str = LOG_NAME):
        self.log_dir, self.write, self.log_name = log_dir, write, log_name
        self.offsets: Dict[int, int] = {}
        self.partial: Dict[int, str] = {}
        self.shown = 0

    def poll(self, final: bool = False) -> None:
        for rank, path in worker_logs(self.log_dir, self.log_name).items():
            try:
                with open(path, "r", encoding="utf-8", errors="replace") as fh:
                    fh.seek(self.offsets.get(rank, 0))
                    chunk = fh.read()
                    self.offsets[rank] = fh.tell()
            except OSError:
                continue
            text = self.partial.pop(rank, "") + chunk
            lines = text.split("\n")
            if not final:
                self.partial[rank] = lines.pop()       # an unfinished last line waits for its end
            for line in lines:
                if line.strip() and not _MS_LOG_RE.match(line):
                    self.write(f"[rank {rank}] {line}\n")
                    self.shown += 1


def run_msrun(plan: MsrunPlan, dry_run: bool = False, out: Optional[TextIO] = None,
              err: Optional[TextIO] = None, verbose: bool = False, poll_s: float = 0.5) -> int:
    """Print this node's command, run it (unless ``dry_run``), return msrun's exit code.

    msrun's own console output (its logger and its tails of every worker log) goes to
    ``<log_dir>/msrun.log``; the console shows, per rank, the lines naohai wrote in the worker logs
    (:class:`WorkerLogFollower`), or with ``verbose`` msrun's whole output as it comes.
    """
    import threading
    import time

    out = out or sys.stdout
    err = err or sys.stderr
    p = validate_plan(plan)
    if p.rank_table_mode == "processes":
        return _run_rank_table(p, dry_run, out, err)
    argv = build_msrun_command(p)
    extra = launch_env(p)
    print(quote(argv, extra), file=out, flush=True)
    if dry_run:
        return 0
    os.makedirs(p.log_dir, exist_ok=True)
    msrun_log = os.path.join(p.log_dir, MSRUN_LOG)
    print(f"naohai launch: {p.per_node} worker(s) on this node; MindSpore's logs go to {p.log_dir} "
          f"({MSRUN_LOG}, {LOG_NAME}_<rank>.log)" + ("" if verbose else "; --verbose shows them here"),
          file=out, flush=True)
    env = {**os.environ, **extra}
    env.setdefault("PYTHONUNBUFFERED", "1")
    started = time.monotonic()
    from naohai.launch.stopping import END_WITH_LAUNCH, JobStopper, start_options
    if p.join:       # the job lives and ends with this process (naohai.launch.stopping)
        env[END_WITH_LAUNCH] = "1"
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                text=True, errors="replace", bufsize=1, **(start_options() if p.join else {}))
    except FileNotFoundError:
        raise UserError("'msrun' was not found on PATH (it ships with mindspore>=2.3)",
                        where=WHERE, key="msrun") from None
    captured: List[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        with open(msrun_log, "a", encoding="utf-8") as fh:
            for line in proc.stdout:
                captured.append(line)
                fh.write(line)
                fh.flush()
                if verbose:
                    out.write(line)
                    out.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    follower = WorkerLogFollower(p.log_dir, lambda line: (out.write(line), out.flush()))
    with JobStopper(proc, p.log_dir, LOG_NAME) if p.join else contextlib.nullcontext():
        while proc.poll() is None:
            if not verbose:
                follower.poll()
            time.sleep(poll_s)
    reader.join(timeout=10)
    if not verbose:
        follower.poll(final=True)
    code = proc.returncode
    if code != 0:
        print(failure_report(p.log_dir, "".join(captured), code), file=err, flush=True)
    elif not p.join:
        print(f"naohai launch: workers started in the background (no --join); logs in {p.log_dir}",
              file=out, flush=True)
    else:
        print(f"naohai launch: {p.per_node} worker(s) finished (exit 0) in {time.monotonic() - started:.0f} s; "
              f"logs in {p.log_dir}", file=out, flush=True)
    return code


def _run_rank_table(p: MsrunPlan, dry_run: bool, out: TextIO, err: TextIO) -> int:
    procs = build_rank_table_processes(p)
    for argv, extra in procs:
        print(quote(argv, extra), file=out)
    if dry_run:
        return 0
    os.makedirs(p.log_dir, exist_ok=True)
    running = []
    for argv, extra in procs:
        log = open(os.path.join(p.log_dir, f"{LOG_NAME}_{extra['RANK_ID']}.log"), "w", encoding="utf-8")
        running.append((int(extra["RANK_ID"]), subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                                                env={**os.environ, **extra}), log))
    worst = 0
    dead = []
    for rank, proc, log in running:
        code = proc.wait()
        log.close()
        if code != 0:
            text = _read(os.path.join(p.log_dir, f"{LOG_NAME}_{rank}.log"))
            dead.append((rank, _describe_code(code), tail(text)))
            worst = worst or (code if code > 0 else 1)
    if worst:
        print(failure_report(p.log_dir, "", worst, dead=dead), file=err, flush=True)
    return worst
