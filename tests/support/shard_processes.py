"""Starts and stops Shard's processes for tests/python, bench/torch_bench.py and scripts/soak.py:
coordinators, workers (shard-worker, or a Python training script) and any other program.

Each process writes its output to a log file of its own. Every wait has a deadline, and a process
that exits when it should not, or still runs at a deadline, raises ProcessError naming it and
showing the end of its log. Signals go to a process by its pid (never to a name), and only until
it is reaped, when its pid could become another process's. Processes stops every process it
started, SIGTERM first and SIGKILL after a grace, also at the end of a with-block:

    with Processes(tmp, build_dir) as processes:
        coordinator = processes.start_coordinator(job=job, state_dir=state)
        worker = processes.start_worker("w0", coordinator.address, script="train.py")
        assert worker.exit_code(timeout=120) == 0, worker.log()

Only the standard library: the soak runs on Debian's python3 without packages.
"""

import contextlib
import os
import signal
import subprocess
import sys
import time

# One compute thread per process, for callers that run several processes on a small machine
# (OpenMP, OpenBLAS and MKL would each start a thread per core in every one of them).
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

TAIL_LINES = 30  # of a log, in an error
POLL_SECONDS = 0.05


class ProcessError(Exception):
    """A process exited when it should have run on, or still ran at a deadline."""


def read_text(path):
    """The text of a log; "" if there is none (a program that could not start wrote nothing)."""
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def read_port(path):
    """The port in a coordinator's port file; 0 before the file is (wholly) written."""
    try:
        with open(path) as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


class Process:
    """One program started with its output (stdout and stderr) in `log_path`."""

    def __init__(self, name, argv, log_path, env, cwd, prefix):
        self.name, self.argv, self.log_path = name, list(argv), log_path
        self.killed = False  # by kill(), on purpose
        os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
        with open(log_path, "w") as log:
            # A session of its own: a Ctrl-C at the terminal reaches only the caller, which then
            # stops what it started (Processes.stop), in order and after saying why.
            self.popen = subprocess.Popen([*prefix, *argv], stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                                          start_new_session=True)
        self.pid = self.popen.pid

    def __str__(self):
        return f"{self.name} (pid {self.pid})"

    def poll(self):
        """The exit status, or None while it runs."""
        return self.popen.poll()

    @property
    def returncode(self):
        return self.poll()

    def alive(self):
        return self.poll() is None

    def signal(self, sig):
        # Popen.send_signal signals the pid only while the process is not reaped.
        self.popen.send_signal(sig)

    def wait(self, timeout=None):
        """The exit status; None if it still runs after `timeout` seconds."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def exit_code(self, timeout):
        """The exit status; raises ProcessError if it still runs after `timeout` seconds."""
        code = self.wait(timeout)
        if code is None:
            raise self.error(f"still runs after {timeout:.1f}s")
        return code

    def kill(self, timeout=5):
        """SIGKILL, on purpose (`killed` is then True); its exit status, None if it has not
        ended after `timeout` seconds."""
        self.killed = True
        self.signal(signal.SIGKILL)
        return self.wait(timeout)

    def ended(self):
        """How it ended: "exited with status N" or "was killed by SIGNAME"."""
        code = self.poll()
        if code is not None and code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with status {code}"

    def log(self):
        return read_text(self.log_path)

    def tail(self, lines=TAIL_LINES):
        return "\n".join(self.log().splitlines()[-lines:])

    def error(self, what):
        """A ProcessError saying that this process `what`, with the end of its log."""
        return ProcessError(f"{self} {what}; the end of {self.log_path}:\n"
                            + (self.tail() or "(empty)"))


class Coordinator(Process):
    """A shard-coordinator that serves: its `port`, and `address` (HOST:PORT) to give workers."""

    port = None
    address = None


class Processes:
    """The processes started through it, their logs in `directory` (a log may be named by a path
    under it or by an absolute path) and the build's programs in `build_dir`/bin. `env` is the
    environment every process starts with (default: this process's, as it is at each start);
    a start's own `env` sets variables over it. stop(), or the end of a with-block, stops every
    process still running, giving each `grace` seconds between SIGTERM and SIGKILL."""

    def __init__(self, directory, build_dir, env=None, grace=5.0):
        self.dir = directory
        self.build_dir = os.path.abspath(build_dir)
        self.bin = os.path.join(self.build_dir, "bin")
        self.env = env
        self.grace = grace
        self.started = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def start(self, name, argv, *, log=None, env=None, cwd=None, prefix=()):
        """`argv` as `name`, its output in `log` (default NAME.log). `prefix` goes before it: a
        wrapper that execs the program in place (`ip netns exec NS`, `setpriv ... --`), so that
        the pid signalled is the program's."""
        return self._start(Process, name, argv, log, self._environment(env), cwd, prefix)

    def start_python(self, name, argv, *, log=None, env=None, cwd=None, prefix=()):
        """`argv` (a script and its arguments, or -m and a module) run by this Python, with the
        build's Python package first on its path."""
        environment = self._environment(env)
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, [
            os.path.join(self.build_dir, "python"), environment.get("PYTHONPATH")]))
        return self._start(Process, name, [sys.executable, *argv], log, environment, cwd, prefix)

    def start_coordinator(self, *flags, job=None, state_dir=None, listen="127.0.0.1:0",
                          name="coordinator", log=None, timeout=30, env=None, cwd=None,
                          prefix=()):
        """shard-coordinator listening on `listen` (port 0: a free one), with `job`, `state_dir`
        and `flags`; returns once it has written its port file (LOG.port). Raises ProcessError if
        it exits first, or if it wrote no port within `timeout` seconds: then it is killed, so
        that another try can listen on the same port."""
        log_path = os.path.join(self.dir, log or f"{name}.log")
        port_file = log_path + ".port"
        with contextlib.suppress(FileNotFoundError):
            os.remove(port_file)  # a previous coordinator's
        argv = [os.path.join(self.bin, "shard-coordinator"), "--listen", listen,
                "--port-file", port_file]
        argv += ["--job", job] if job else []
        argv += ["--state-dir", state_dir] if state_dir else []
        coordinator = self._start(Coordinator, name, argv + list(flags), log_path,
                                  self._environment(env), cwd, prefix)
        give_up = time.monotonic() + timeout
        while not read_port(port_file):
            if not coordinator.alive():
                raise coordinator.error(f"{coordinator.ended()} before it served")
            if time.monotonic() > give_up:
                coordinator.kill()
                raise coordinator.error(f"wrote no port to {port_file} within {timeout:.1f}s "
                                        "(killed)")
            time.sleep(POLL_SECONDS)
        coordinator.port = read_port(port_file)
        coordinator.address = f"{listen.rpartition(':')[0]}:{coordinator.port}"
        return coordinator

    def start_worker(self, worker_id, coordinator, *flags, script=None, name=None, log=None,
                     env=None, cwd=None, prefix=()):
        """A worker that joins `coordinator` (HOST:PORT) as `worker_id`, started as `name`
        (default: the id): shard-worker with `flags`, or with `script` that Python training
        script with `flags` as its arguments, told where to join by the variables
        shard.torch.join() reads."""
        name = name or worker_id
        if script is None:
            argv = [os.path.join(self.bin, "shard-worker"), "--coordinator", coordinator,
                    "--id", worker_id, *flags]
            return self.start(name, argv, log=log, env=env, cwd=cwd, prefix=prefix)
        env = {"SHARD_COORDINATOR": coordinator, "SHARD_ID": worker_id, **(env or {})}
        return self.start_python(name, [script, *flags], log=log, env=env, cwd=cwd,
                                 prefix=prefix)

    def stop(self):
        """Stops every process started here that still runs: SIGTERM, then SIGKILL to those
        still running after the grace; forgets them all."""
        running = [proc for proc in self.started if proc.alive()]
        for proc in running:
            proc.signal(signal.SIGTERM)
            proc.signal(signal.SIGCONT)  # a stopped process would hold its SIGTERM until then
        give_up = time.monotonic() + self.grace
        for proc in running:
            if proc.wait(max(0.0, give_up - time.monotonic())) is None:
                proc.signal(signal.SIGKILL)
                proc.wait(self.grace)
        self.started = []

    def _environment(self, env):
        return dict(os.environ if self.env is None else self.env, **(env or {}))

    def _start(self, cls, name, argv, log, environment, cwd, prefix):
        proc = cls(name, argv, os.path.join(self.dir, log or f"{name}.log"), environment, cwd,
                   prefix)
        self.started.append(proc)
        return proc


def wait_all(procs, timeout):
    """Waits up to `timeout` seconds for every one of `procs` to exit 0; raises ProcessError for
    the first that exits otherwise, or for those still running then. The others are left
    running: stop them (Processes.stop) when they wait on the one that failed."""
    give_up = time.monotonic() + timeout
    pending = list(procs)
    while pending:
        for proc in list(pending):
            if proc.poll() is None:
                continue
            pending.remove(proc)
            if proc.returncode != 0:
                raise proc.error(proc.ended())
        if pending and time.monotonic() > give_up:
            others = ", ".join(p.name for p in pending[1:])
            raise pending[0].error(f"still runs after {timeout:.1f}s"
                                   + (f", as do {others}" if others else ""))
        if pending:
            time.sleep(POLL_SECONDS)
