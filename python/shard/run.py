"""Starts the ranks of a Shard job on this host, as torchrun does for torch.distributed.

    python3 -m shard.run --standalone --job job.json --nproc-per-node 4 train.py --lr 0.1
    python3 -m shard.run --coordinator 10.0.0.1:7460 --host 10.0.0.2 --nproc-per-node 8 train.py

With --standalone it first starts a shard-coordinator for the job on a free port; with
--coordinator the ranks join one that runs elsewhere (one launcher per host). Each rank is
`python3 train.py args...` (this interpreter) with the environment shard.torch.join() reads:
SHARD_COORDINATOR, SHARD_ID (unique per process), SHARD_HOST, SHARD_DEVICE, plus LOCAL_RANK and
LOCAL_WORLD_SIZE as torchrun sets them. Global ranks are not known here: the coordinator hands
them out when the world forms, and again whenever it re-forms.

A rank that dies abnormally is started again, up to --max-restarts times in all, under a new
worker id: it joins as a standby (or takes the free rank) and the coordinator folds it in
(docs/elasticity.md), while the survivors go on. A rank that exits 0 is done. SIGINT, SIGTERM
and SIGHUP are passed on to everything the launcher started; what is left after --stop-grace
is killed.
"""

import argparse
import ctypes
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

USAGE_ERROR = 2
TICK = 0.1  # seconds between two looks at the processes and their logs
WORKER_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
COORDINATOR_EXIT_WAIT = 30  # seconds the coordinator may take to exit once every rank finished

EPILOG = """\
examples:
  # one host, a coordinator of its own: 4 ranks, up to 3 restarts
  python3 -m shard.run --standalone --job job.json --nproc-per-node 4 --max-restarts 3 \\
      examples/torch/transformer.py --dim 128

  # two hosts joining a coordinator on 10.0.0.1:7460 (started there with shard-coordinator)
  host-a$ python3 -m shard.run --coordinator 10.0.0.1:7460 --host 10.0.0.2 \\
              --nproc-per-node 8 --max-restarts 4 train.py
  host-b$ python3 -m shard.run --coordinator 10.0.0.1:7460 --host 10.0.0.3 \\
              --nproc-per-node 8 --max-restarts 4 train.py

  # a shorter lease for a test (any shard-coordinator flag, written with '=')
  python3 -m shard.run --standalone --job job.json --coordinator-arg=--lease=1s \\
      --coordinator-arg=--reform-grace=1s --nproc-per-node 2 train.py

Besides SHARD_COORDINATOR, SHARD_ID, SHARD_HOST, SHARD_DEVICE, LOCAL_RANK and LOCAL_WORLD_SIZE,
the ranks get OMP_NUM_THREADS=1 when there are several and it is not set, as with torchrun, and
PYTHONUNBUFFERED=1 unless set. The coordinator gets the environment without its SHARD_*
variables, which are the ranks' (configure it with --coordinator-arg).

The log directory holds coordinator.log (with --standalone), one <worker id>.log per rank
process (a restarted rank gets a new file), and processes.json: the launcher's pid, the
coordinator's pid and address, and each local rank's current worker id, pid, log and state,
rewritten whenever one of them changes.

Exit status: 0 when every rank exited 0 (and, with --standalone, the coordinator too); 1 when a
rank failed beyond --max-restarts, the coordinator failed or did not start; 2 for a usage error;
128 + the signal's number after SIGINT, SIGTERM or SIGHUP (130 after Ctrl-C).
"""


class UsageError(Exception):
    """A mistake in the command line or the environment it names: exit 2 with the message."""


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python3 -m shard.run", description=__doc__, epilog=EPILOG, allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_argument_group("where the coordinator is (one of)")
    where.add_argument("--standalone", action="store_true",
                       help="start a shard-coordinator for --job on this host, on a free port")
    where.add_argument("--coordinator", metavar="HOST:PORT",
                       help="join the coordinator running there (start one launcher per host)")
    standalone = parser.add_argument_group("with --standalone")
    standalone.add_argument("--job", metavar="FILE",
                            help="the job spec (JSON, \"model\": {\"external\": {}}; "
                            "docs/training.md)")
    standalone.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT",
                            help="where the coordinator serves (default 127.0.0.1:0: a free port "
                            "on loopback)")
    standalone.add_argument("--state-dir", metavar="DIR",
                            help="the coordinator's state directory (default LOG_DIR/state: a "
                            "new job every run)")
    standalone.add_argument("--coordinator-arg", action="append", default=[], metavar="ARG",
                            help="one more argument for shard-coordinator, repeatable; write it "
                            "with '=' (--coordinator-arg=--lease=1s) so that it is not read as "
                            "the launcher's own")
    standalone.add_argument("--coordinator-bin", metavar="PATH",
                            help="the shard-coordinator binary (default: SHARD_COORDINATOR_BIN, "
                            "else next to this package in a build tree or an install prefix, "
                            "else PATH)")
    standalone.add_argument("--coordinator-start-timeout", type=float, default=30.0,
                            metavar="SECONDS",
                            help="how long the coordinator may take to serve (default 30)")
    ranks = parser.add_argument_group("the ranks")
    ranks.add_argument("--nproc-per-node", type=int, default=1, metavar="N",
                       help="ranks to start on this host (default 1)")
    ranks.add_argument("--max-restarts", type=int, default=0, metavar="K",
                       help="restarts of ranks that die abnormally, in all (default 0)")
    ranks.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                       help="SHARD_DEVICE of the ranks: cuda gives local rank i cuda:i and "
                       "needs a GPU per rank; cpu; auto (the default) is cuda when this host "
                       "has GPUs, else cpu")
    ranks.add_argument("--host", default="127.0.0.1",
                       help="SHARD_HOST: the address ranks on other hosts reach these ranks at "
                       "(default 127.0.0.1: one host)")
    ranks.add_argument("--id-prefix", default=socket.gethostname(),
                       help="worker ids are PREFIX-<local rank>, PREFIX-<local rank>-r<n> after "
                       "a restart; unique per host (default the host name)")
    ranks.add_argument("--stop-grace", type=float, default=5.0, metavar="SECONDS",
                       help="how long processes told to stop (a signal passed on, or ranks "
                       "still running when the coordinator finished) get before they are "
                       "killed (default 5)")
    output = parser.add_argument_group("output")
    output.add_argument("--log-dir", metavar="DIR",
                        help="where the logs go (default: a new temporary directory)")
    output.add_argument("--quiet", action="store_true",
                        help="do not stream the ranks' output (it is in their logs anyway)")
    parser.add_argument("script", help="the training script, run as `python3 SCRIPT ARGS...`")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="the script's arguments")
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except UsageError as e:
        parser.error(str(e))
    return args


def check_args(args):
    """The checks argparse cannot express; raises UsageError saying what to write instead."""
    if args.standalone == bool(args.coordinator):
        hint = ""
        if {"--standalone", "--coordinator"} & set(args.script_args):
            hint = " (the launcher's options go before the script; what follows it is the script's)"
        raise UsageError("say where the coordinator is: --standalone --job FILE starts one for the "
                         "job, --coordinator HOST:PORT joins a running one" + hint)
    if args.standalone:
        if not args.job:
            raise UsageError("--standalone needs --job FILE, the job spec the coordinator runs")
        if not os.path.isfile(args.job):
            raise UsageError(f"--job {args.job}: no such file")
        split_address(args.listen, "--listen")
    else:
        for flag, given in (("--job", args.job), ("--state-dir", args.state_dir),
                            ("--coordinator-arg", args.coordinator_arg)):
            if given:
                raise UsageError(f"{flag} is for --standalone; with --coordinator the running "
                                 "coordinator already has its job")
        split_address(args.coordinator, "--coordinator")
    if not os.path.isfile(args.script):
        raise UsageError(f"{args.script}: no such file (the training script)")
    if args.nproc_per_node < 1:
        raise UsageError("--nproc-per-node must be at least 1")
    if args.max_restarts < 0:
        raise UsageError("--max-restarts must not be negative")
    if args.stop_grace < 0 or args.coordinator_start_timeout <= 0:
        raise UsageError("--stop-grace must not be negative, --coordinator-start-timeout must be "
                         "positive")
    longest = f"{args.id_prefix}-{args.nproc_per_node - 1}"
    if args.max_restarts:
        longest += f"-r{args.max_restarts}"
    if not WORKER_ID.fullmatch(longest):
        raise UsageError(f"--id-prefix {args.id_prefix!r} makes worker ids such as {longest!r}; "
                         "ids are at most 128 characters of [A-Za-z0-9._-]")


def split_address(address, flag):
    """(host, port) of HOST:PORT or [V6]:PORT; UsageError naming `flag` otherwise."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise UsageError(f"{flag} {address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def find_coordinator_bin(explicit):
    """The shard-coordinator to start: --coordinator-bin, SHARD_COORDINATOR_BIN, the bin/ of the
    build tree or install prefix this package lies in, or PATH, in that order."""
    for given, source in ((explicit, "--coordinator-bin"),
                          (os.environ.get("SHARD_COORDINATOR_BIN"), "SHARD_COORDINATOR_BIN")):
        if given:
            if not (os.path.isfile(given) and os.access(given, os.X_OK)):
                raise UsageError(f"{source} {given}: not an executable file")
            return given
    package = pathlib.Path(__file__).resolve().parent
    # A build tree copies the package to build/python/shard next to build/bin; an install puts
    # it in <prefix>/<libdir>/python3/dist-packages/shard, libdir being lib, lib64 or
    # lib/<multiarch>, and the binaries in <prefix>/bin.
    candidates = [package.parent.parent / "bin"]
    if package.parent.name == "dist-packages" and package.parent.parent.name == "python3":
        libdir = package.parent.parent.parent
        prefix = libdir.parent.parent if libdir.parent.name == "lib" else libdir.parent
        candidates.append(prefix / "bin")
    for directory in candidates:
        binary = directory / "shard-coordinator"
        if binary.is_file() and os.access(binary, os.X_OK):
            return str(binary)
    on_path = shutil.which("shard-coordinator")
    if on_path:
        return on_path
    looked = ", ".join(str(d) for d in candidates)
    raise UsageError(f"cannot find shard-coordinator (looked in {looked} and PATH): pass "
                     "--coordinator-bin PATH or set SHARD_COORDINATOR_BIN, or build it "
                     "(scripts/build.sh --target shard-coordinator)")


def gpu_count():
    """How many GPUs the ranks can use, as torch counts them (CUDA_VISIBLE_DEVICES included).
    torch is imported only on a host with an NVIDIA driver: the import takes seconds."""
    if shutil.which("nvidia-smi") is None and not os.path.exists("/dev/nvidiactl"):
        return 0
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count()


def rank_devices(choice, ranks):
    """SHARD_DEVICE for each local rank; UsageError when --device cuda (or auto on a host with
    GPUs) finds fewer GPUs than ranks."""
    if choice == "cpu":
        return ["cpu"] * ranks
    count = gpu_count()
    if choice == "auto" and count == 0:
        return ["cpu"] * ranks
    if count == 0:
        raise UsageError("--device cuda: this host has no GPU that torch can see (check "
                         "nvidia-smi and CUDA_VISIBLE_DEVICES), or train on the CPU with "
                         "--device cpu")
    if count < ranks:
        raise UsageError(f"{ranks} ranks need a GPU each and this host has {count} (as torch "
                         "counts them, CUDA_VISIBLE_DEVICES included): start at most "
                         f"{count} with --nproc-per-node, or train on the CPU with --device cpu")
    return [f"cuda:{i}" for i in range(ranks)]


def plural(count, noun, nouns=None):
    return f"{count} {noun if count == 1 else nouns or noun + 's'}"


def read_port(path):
    """The port in the coordinator's port file (written atomically once it serves); None before."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None
    return int(text) if text else None


def _die_with_parent_hook():
    """A preexec_fn that has the kernel SIGKILL the child if the launcher dies, so that even a
    launcher killed with SIGKILL leaves no rank behind (Linux only, else None). The function is
    looked up here, in the parent: the child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    launcher = os.getpid()
    pr_set_pdeathsig = 1

    def hook():
        prctl(pr_set_pdeathsig, signal.SIGKILL)
        if os.getppid() != launcher:  # the launcher died before the hook ran
            os._exit(1)

    return hook


def describe_exit(code):
    """A Popen return code in words: "exited with status 3", "died of SIGKILL"."""
    if code >= 0:
        return f"exited with status {code}"
    try:
        return f"died of {signal.Signals(-code).name}"
    except ValueError:
        return f"died of signal {-code}"


class LogTail:
    """Follows one log file, printing each complete line with a prefix. Ranks write their own
    files, so a slow or dead launcher never blocks them and the logs are whole."""

    def __init__(self, path, prefix):
        self.file = open(path, "rb")
        self.prefix = prefix
        self.partial = b""

    def pump(self, out, final=False):
        data = self.partial + self.file.read()
        lines = data.split(b"\n")
        self.partial = lines.pop()
        if final and self.partial:
            lines.append(self.partial)
            self.partial = b""
        for line in lines:
            out.write(f"{self.prefix} {line.decode(errors='replace')}\n")
        if lines:
            out.flush()
        if final:
            self.file.close()


class Rank:
    """One local rank: its current process, worker id and log, and how often it restarted."""

    def __init__(self, local_rank, device):
        self.local_rank = local_rank
        self.device = device
        self.restarts = 0
        self.proc = None
        self.worker_id = None
        self.log = None
        self.tail = None
        self.state = "starting"  # running, finished, failed, stopped
        self.exit_code = None


class Launcher:
    """Starts the coordinator (with --standalone) and the ranks, restarts ranks, passes signals
    on, streams the output; every process it starts is tracked by its pid, in a process group of
    its own (so a signal also reaches what a rank started, such as data loader workers)."""

    def __init__(self, args, coordinator_bin, devices):
        self.args = args
        self.coordinator_bin = coordinator_bin
        self.log_dir = os.path.abspath(args.log_dir or tempfile.mkdtemp(prefix="shard-run-"))
        os.makedirs(self.log_dir, exist_ok=True)
        self.ranks = [Rank(i, device) for i, device in enumerate(devices)]
        self.coordinator = None
        self.coordinator_address = args.coordinator
        self.coordinator_log = None
        self.restarts = 0
        self.signals = []  # the stop signals received, in order
        self.out = sys.stdout
        self.pre_exec = _die_with_parent_hook()

    def say(self, message):
        self.out.write(f"[shard.run] {message}\n")
        self.out.flush()

    def on_signal(self, signum, _frame):
        self.signals.append(signum)

    def run(self):
        """The whole launch; returns the exit status."""
        for signum in STOP_SIGNALS:
            signal.signal(signum, self.on_signal)
        self.say(f"logs in {self.log_dir} (processes.json lists what runs)")
        try:
            if self.args.standalone and not self.start_coordinator():
                return self.stop_status(128 + self.signals[0] if self.signals else 1)
            self.note_rank_environment()
            for rank in self.ranks:
                self.start_rank(rank)
            return self.supervise()
        finally:
            self.stop_everything(signal.SIGTERM)

    # --- the coordinator -------------------------------------------------------------------

    def start_coordinator(self):
        """Starts shard-coordinator and waits for its port file; False (and says why) when it
        exits or does not serve in time, or a signal arrives meanwhile."""
        port_file = os.path.join(self.log_dir, "coordinator.port")
        if os.path.exists(port_file):
            os.remove(port_file)
        self.coordinator_log = os.path.join(self.log_dir, "coordinator.log")
        state_dir = self.args.state_dir or os.path.join(self.log_dir, "state")
        argv = [self.coordinator_bin, "--job", os.path.abspath(self.args.job),
                "--listen", self.args.listen, "--port-file", port_file, "--state-dir", state_dir,
                *self.args.coordinator_arg]
        # Not the SHARD_* variables: they are for the ranks, and some mean something else to
        # shard-coordinator (SHARD_TLS_CERT is a rank's client certificate, the coordinator's
        # server certificate). --coordinator-arg configures the coordinator.
        env = {name: value for name, value in os.environ.items() if not name.startswith("SHARD_")}
        self.coordinator = self.spawn(argv, env, self.coordinator_log)
        self.write_processes()
        deadline = time.monotonic() + self.args.coordinator_start_timeout
        while read_port(port_file) is None:
            if self.signals:
                return False
            if self.reap(self.coordinator):
                code = self.coordinator.returncode
                self.fail_coordinator(f"shard-coordinator {describe_exit(code)} before serving")
                return False
            if time.monotonic() > deadline:
                self.fail_coordinator(f"shard-coordinator did not serve within "
                                      f"{self.args.coordinator_start_timeout:g}s "
                                      "(--coordinator-start-timeout)")
                return False
            time.sleep(TICK / 2)
        host, _ = split_address(self.args.listen, "--listen")
        if host in ("", "0.0.0.0", "::"):
            host = "127.0.0.1"  # serving every address: the ranks here use loopback
        if ":" in host:
            host = f"[{host}]"
        self.coordinator_address = f"{host}:{read_port(port_file)}"
        self.write_processes()
        self.say(f"coordinator {self.coordinator_bin} at {self.coordinator_address} "
                 f"(pid {self.coordinator.pid}, "
                 f"log {self.coordinator_log}, state {state_dir})")
        return True

    def fail_coordinator(self, why):
        with open(self.coordinator_log, errors="replace") as f:
            tail = f.readlines()[-20:]
        sys.stderr.write(f"shard.run: {why}; the end of {self.coordinator_log}:\n"
                         + "".join("  " + line for line in tail))
        sys.stderr.flush()

    # --- the ranks -------------------------------------------------------------------------

    def note_rank_environment(self):
        if "OMP_NUM_THREADS" not in os.environ and len(self.ranks) > 1:
            # torchrun does the same: N ranks with a thread per core each would oversubscribe.
            self.say("OMP_NUM_THREADS=1 for every rank (set it to choose otherwise)")
        if self.args.coordinator and self.args.host == "127.0.0.1":
            host, _ = split_address(self.args.coordinator, "--coordinator")
            if host not in ("127.0.0.1", "localhost", "::1"):
                self.say("warning: ranks on other hosts cannot reach these ranks at 127.0.0.1; "
                         "pass --host with an address they can reach")

    def rank_environment(self, rank):
        env = dict(os.environ)
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env.update(SHARD_COORDINATOR=self.coordinator_address, SHARD_ID=rank.worker_id,
                   SHARD_HOST=self.args.host, SHARD_DEVICE=rank.device,
                   LOCAL_RANK=str(rank.local_rank), LOCAL_WORLD_SIZE=str(len(self.ranks)),
                   # The ranks import the same shard package as the launcher.
                   PYTHONPATH=os.pathsep.join(filter(None, [package_root,
                                                            os.environ.get("PYTHONPATH")])))
        env.setdefault("PYTHONUNBUFFERED", "1")  # lines reach the log (and the stream) at once
        if len(self.ranks) > 1:
            env.setdefault("OMP_NUM_THREADS", "1")
        return env

    def start_rank(self, rank):
        suffix = f"-r{rank.restarts}" if rank.restarts else ""
        rank.worker_id = f"{self.args.id_prefix}-{rank.local_rank}{suffix}"
        rank.log = os.path.join(self.log_dir, f"{rank.worker_id}.log")
        argv = [sys.executable, self.args.script, *self.args.script_args]
        rank.proc = self.spawn(argv, self.rank_environment(rank), rank.log)
        rank.state, rank.exit_code = "running", None
        if not self.args.quiet:
            rank.tail = LogTail(rank.log, f"[rank {rank.local_rank}]")
        self.write_processes()
        self.say(f"rank {rank.local_rank}: worker {rank.worker_id}, pid {rank.proc.pid}, "
                 f"device {rank.device}, log {rank.log}")

    def spawn(self, argv, env, log_path):
        with open(log_path, "wb") as log:
            return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=self.pre_exec)

    def pump_logs(self, final=False):
        for rank in self.ranks:
            if rank.tail is not None:
                rank.tail.pump(self.out, final=final and rank.state != "running")
                if final and rank.state != "running":
                    rank.tail = None

    # --- supervision -----------------------------------------------------------------------

    def running(self):
        return [rank for rank in self.ranks if rank.state == "running"]

    def supervise(self):
        """Watches the ranks (and the coordinator) until the job ends; returns the exit status."""
        while True:
            self.pump_logs()
            if self.signals:
                return self.stop_status(128 + self.signals[0])
            if self.coordinator is not None and self.reap(self.coordinator):
                return self.after_coordinator()
            for rank in self.running():
                if self.reap(rank.proc) and not self.rank_exited(rank, restart=True):
                    return self.stop_status(1)
            if not self.running():
                return self.after_ranks()
            time.sleep(TICK)

    def rank_exited(self, rank, restart):
        """Records a rank's exit: finished with 0, else failed, and with `restart` started again
        under a new id while restarts are left. False when it failed for good."""
        code = rank.exit_code = rank.proc.returncode
        if rank.tail is not None:
            rank.tail.pump(self.out, final=True)
            rank.tail = None
        who = f"rank {rank.local_rank} (worker {rank.worker_id}, pid {rank.proc.pid})"
        if code == 0:
            rank.state = "finished"
            self.write_processes()
            self.say(f"{who} finished")
            return True
        rank.state = "failed"
        self.write_processes()
        if not restart:
            self.say(f"{who} {describe_exit(code)} (log {rank.log})")
            return False
        if self.restarts >= self.args.max_restarts:
            self.say(f"{who} {describe_exit(code)} with no restart left (--max-restarts "
                     f"{self.args.max_restarts}): stopping everything (log {rank.log})")
            return False
        self.restarts += 1
        rank.restarts += 1
        self.say(f"{who} {describe_exit(code)}; restarting it (restart {self.restarts} of "
                 f"{self.args.max_restarts}) under a new worker id")
        self.start_rank(rank)
        return True

    def after_ranks(self):
        """Every rank finished: with --standalone, the job is over once the coordinator exits too
        (it does when every rank has left: training finished, or an operator stopped it)."""
        if self.coordinator is None:
            self.say(f"done: {plural(len(self.ranks), 'rank')} finished, "
                     f"{plural(self.restarts, 'restart')}")
            return 0
        deadline = time.monotonic() + COORDINATOR_EXIT_WAIT
        while not self.reap(self.coordinator):
            if self.signals:
                return self.stop_status(128 + self.signals[0])
            if time.monotonic() > deadline:
                self.fail_coordinator("every rank finished but shard-coordinator is still running "
                                      f"after {COORDINATOR_EXIT_WAIT}s")
                return self.stop_status(1)
            time.sleep(TICK)
        return self.after_coordinator()

    def after_coordinator(self):
        """The coordinator exited. With status 0 the job is over: the ranks still running are
        leaving, or are standbys it no longer needs; none is restarted now, and what has not
        exited after --stop-grace is stopped. The job succeeded if no rank failed."""
        self.write_processes()
        code = self.coordinator.returncode
        if code != 0:
            self.fail_coordinator(f"shard-coordinator {describe_exit(code)}")
            return self.stop_status(1)
        deadline = time.monotonic() + self.args.stop_grace
        while self.running() and time.monotonic() < deadline:
            self.pump_logs()
            if self.signals:
                return self.stop_status(128 + self.signals[0])
            for rank in self.running():
                if self.reap(rank.proc):
                    self.rank_exited(rank, restart=False)
            time.sleep(TICK)
        if self.running():
            self.say(f"{plural(len(self.running()), 'rank')} still running "
                     f"{self.args.stop_grace:g}s after the coordinator finished")
            self.stop_everything(signal.SIGTERM)
        if any(rank.state == "failed" for rank in self.ranks):
            self.say("failed: the coordinator finished, but not every rank exited 0")
            return 1
        self.say(f"done: the coordinator and the ranks finished, "
                 f"{plural(self.restarts, 'restart')}")
        return 0

    def reap(self, proc):
        """True once `proc` has exited, and then its process group is killed: whatever it left
        behind (data loader workers) does not outlive it. The exit is seen without reaping it
        first (WNOWAIT), so that its pid, the group's id, cannot be reused in between."""
        if proc.returncode is not None:
            return True
        try:
            exited = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            exited = True
        if not exited:
            return False
        kill_group(proc.pid, signal.SIGKILL)
        proc.wait()
        return True

    # --- stopping ------------------------------------------------------------------------------

    def live(self):
        procs = [rank.proc for rank in self.ranks if rank.proc is not None]
        if self.coordinator is not None:
            procs.append(self.coordinator)
        return [proc for proc in procs if not self.reap(proc)]

    def stop_status(self, status):
        """Stops everything (passing on the signal that arrived, if one did) and returns
        `status`."""
        self.stop_everything(self.signals[0] if self.signals else signal.SIGTERM)
        return status

    def stop_everything(self, signum):
        """Sends `signum` to every process still running, waits up to --stop-grace for them (a
        second signal cuts the wait short), then kills the rest; returns when all are gone."""
        live = self.live()
        if live:
            self.say(f"stopping {plural(len(live), 'process', 'processes')} "
                     f"({signal.Signals(signum).name}, "
                     f"then SIGKILL after {self.args.stop_grace:g}s)")
            signals_before = len(self.signals)
            for proc in live:
                kill_group(proc.pid, signum)
            deadline = time.monotonic() + self.args.stop_grace
            while live and time.monotonic() < deadline and len(self.signals) == signals_before:
                time.sleep(TICK / 2)
                live = self.live()
            for proc in live:
                kill_group(proc.pid, signal.SIGKILL)
            for proc in live:
                self.reap(proc)
        for rank in self.ranks:
            if rank.state == "running":
                rank.state, rank.exit_code = "stopped", rank.proc.returncode
        self.pump_logs(final=True)
        self.write_processes()

    def write_processes(self):
        """processes.json in the log directory, replaced atomically: what runs, for scripts and
        tests that need a pid (to kill a rank, to check that everything is gone)."""
        coordinator = None
        if self.coordinator is not None:
            coordinator = {"pid": self.coordinator.pid, "address": self.coordinator_address,
                           "log": self.coordinator_log,
                           "running": self.coordinator.returncode is None}
        ranks = [{"local_rank": rank.local_rank, "worker_id": rank.worker_id,
                  "pid": rank.proc.pid if rank.proc else None, "log": rank.log,
                  "state": rank.state, "exit_code": rank.exit_code, "restarts": rank.restarts}
                 for rank in self.ranks]
        record = {"launcher": os.getpid(), "coordinator": coordinator, "ranks": ranks,
                  "restarts": self.restarts, "max_restarts": self.args.max_restarts}
        path = os.path.join(self.log_dir, "processes.json")
        with open(path + ".tmp", "w") as f:
            json.dump(record, f, indent=1)
        os.replace(path + ".tmp", path)


def kill_group(pgid, signum):
    """Signals the process group `pgid` (a child the launcher started in a session of its own)."""
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        coordinator_bin = find_coordinator_bin(args.coordinator_bin) if args.standalone else None
        devices = rank_devices(args.device, args.nproc_per_node)
    except UsageError as e:
        sys.stderr.write(f"shard.run: error: {e}\n")
        return USAGE_ERROR
    return Launcher(args, coordinator_bin, devices).run()


if __name__ == "__main__":
    sys.exit(main())
