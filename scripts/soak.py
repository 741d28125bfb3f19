#!/usr/bin/python3
"""Process-level soak of Shard: real binaries, random faults, one seed.

A coordinator and N CPU workers (build/bin) train a small MLP with a checkpoint every few
steps (and, unless --snapshot-every, no in-memory snapshots: every recovery goes through disk)
while faults chosen from the seed hit them: a worker SIGKILLed (replaced at once or
late, by a process with the same id or a new one), a worker SIGSTOPped (then SIGCONTed, or
SIGKILLed and replaced), the coordinator SIGKILLed and started again with the same command
line on the same port and state directory, `shardctl resize` and `shardctl drain`, and (with
--partitions, as root) network partitions that heal after a while: two workers' hosts from each
other, one worker's host from every peer, or the coordinator's host from some of the workers'
(and with --disk-faults, as root, the checkpoint disk, a tmpfs of its own, filled to ENOSPC and
freed a few seconds later).
A fault fires during training steps, right after a checkpoint was requested (during a save) or
while the world is still re-forming after the previous fault.

With --partitions every process runs on test hosts made of network namespaces on a bridge
(scripts/fault-hosts.sh, tests/faults/hosts.py, docs/faults.md): the coordinator on a host of
its own, the workers spread over one host per worker slot; a partition is iptables DROP rules in
the hosts' namespaces. The references still run on this machine's loopback.

It passes (exit 0) only if:
  - there was no hang: training progress (the coordinator's step metric) never stood still
    for longer than --hang-after while the script was not injecting faults, and training
    moved within --partition-hang-after (90 s) of each partition's start;
  - no worker exited on its own with an error;
  - the job finished on its own (the coordinator exited 0 after "training finished");
  - every checkpoint in the coordinator's catalog (`shardctl checkpoint list --json`)
    verifies (`shardctl checkpoint verify`);
  - the event history (`shardctl events --json`) survives every coordinator restart: the
    events listed before a kill are listed again, unchanged, after the restart and at the end;
  - the final parameters are bitwise equal to a reference run without faults that restores
    the checkpoint the final world restored, on the same world size (the bound the chaos
    tests use; with no restore, a run from scratch on that size). With --snapshot-every N the
    job also takes a memory snapshot every N steps, with one replica, and recovers from one
    where it can; it then saves a disk checkpoint every step (unless --every says otherwise)
    and keeps them all (unless --keep-last does), so that a final world that restored a memory
    snapshot is compared with a reference that restores the disk checkpoint saved at the same
    boundary (the same id: step and generation): the memory path (replicas, fetches from
    peers, resharding) must give the disk's bits.
It also compares with an undisturbed run from scratch on the original world size (the
largest difference is information, not a pass/fail) and prints a table: faults survived,
hangs, time lost per fault, steps, checkpoints verified, the reference comparison.

It reads the coordinator's history only through shardctl, never from the state directory's
files (see Soak.inspect_state for the end of a finished job, whose coordinator has exited).

Every process it starts is tracked by pid (tests/support/shard_processes.py) and stopped on
every exit path (and killed through PR_SET_PDEATHSIG if this script itself is killed).
Everything lives in one temporary directory, kept on failure or with --keep. Only the Python
standard library is used.

    scripts/soak.sh [--seed S] [--kills 20] [--coordinator-kills 3] [--stops N] [--resizes N]
                    [--drains N] [--partitions N] [--workers 4] [--steps N]
                    [--duration SECONDS] [--lease 1s] [--grace 1s] [--every 5]
                    [--snapshot-every N] [--keep] [--build-dir build]

See docs/elasticity.md ("Soak") for how to read the report.
"""

import argparse
import bisect
import concurrent.futures
import datetime
import errno
import heapq
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Test hosts made of network namespaces, for --partitions (docs/faults.md), and the process
# harness shared with tests/ and bench/. Neither folder is a package: their directories go on the
# import path, found from this file so that the soak runs from anywhere.
sys.path.insert(0, os.path.join(ROOT, "tests", "faults"))
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))
import hosts as fault_hosts  # noqa: E402
from shard_processes import Processes, ProcessError  # noqa: E402


# ----------------------------------------------------------------------------------------------
# Small helpers


def parse_duration(text):
    """'1s', '1500ms', '2m', '0.5' (seconds) -> seconds."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|h)?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 1s, 1500ms)")
    value = float(match.group(1))
    return value * {"ms": 0.001, "s": 1, "m": 60, "h": 3600, None: 1}[match.group(2)]


def duration_flag(seconds):
    return f"{int(round(seconds * 1000))}ms"


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def log_line_time(line):
    """When a log line of our binaries ("2026-11-22T16:27:14.750 I ...") was written."""
    try:
        return datetime.datetime.strptime(line[:23], "%Y-%m-%dT%H:%M:%S.%f").timestamp()
    except ValueError:
        return None


def median_max(values):
    if not values:
        return "-", "-"
    return f"{statistics.median(values):.2f}", f"{max(values):.2f}"


class Hang(Exception):
    """Training stood still for longer than the hang bound."""


class SoakFailure(Exception):
    """Something the soak cannot go on from (a crashed coordinator, the deadline, ...)."""


# ----------------------------------------------------------------------------------------------
# The schedule of faults: a pure function of the seed and the flags.


class Fault:
    # A new kind needs: its count flag and its place in make_schedule's list, its parameters
    # drawn in draw_kind_details (and shown by describe), an inject_<kind> method of Soak called
    # from Soak.inject (as inject_partition and inject_disk are), and a label in Soak.report's
    # `labels`.
    KINDS = ("kill", "stop", "coordinator", "resize", "drain", "partition", "disk")

    def __init__(self, **fields):
        self.index = 0
        self.kind = ""
        self.timing = "steps"  # steps | save | reform
        self.gap = 0  # steps/save: fire this many steps after the world settled
        self.delay = 0.0  # reform: seconds after the previous fault; save: after the request
        self.pick = 0.0  # which worker: this fraction into the sorted candidates
        self.replace = "now"  # kill, stop->kill, drain: replacement "now" or "late"
        self.replace_delay = 0.0
        self.same_id = False  # the replacement reuses the id (a restarted pod)
        self.then = ""  # stop: "cont" or "kill"
        self.stopped_for = 0.0
        self.down_for = 0.0  # coordinator: seconds before the restart
        self.size = 0  # resize: the new world size
        self.variant = ""  # partition: "pair", "worker" (from every peer), "coordinator"
        self.cut = 0  # partition, coordinator variant: how many worker hosts lose it
        self.duration = 0.0  # partition, disk: seconds until it heals (space is freed)
        self.healed = False
        self.longest_quiet = 0.0  # partition: the longest standstill of training after it
        self.__dict__.update(fields)
        # What happened (filled in while it runs).
        self.fired_at = None
        self.what = ""
        self.lost = None  # seconds from the fault to the next world's first step
        self.skipped = ""

    def describe(self):
        parts = [self.kind]
        if self.kind in ("kill", "drain") or (self.kind == "stop" and self.then == "kill"):
            parts.append(f"replacement {self.replace}"
                         + (f" +{self.replace_delay:.1f}s" if self.replace == "late" else "")
                         + (" same id" if self.same_id else " new id"))
        if self.kind == "stop":
            parts.append(f"for {self.stopped_for:.1f}s then {self.then.upper()}")
        if self.kind == "coordinator":
            parts.append(f"down {self.down_for:.1f}s")
        if self.kind == "resize":
            parts.append(f"to {self.size}")
        if self.kind == "partition":
            parts.append({"pair": "two workers' hosts from each other",
                          "worker": "a worker's host from every peer",
                          "coordinator": f"the coordinator from {self.cut} worker host(s)"}
                         [self.variant] + f" for {self.duration:.1f}s")
        if self.kind == "disk":
            parts.append(f"the checkpoint disk full for {self.duration:.1f}s")
        when = {"steps": f"{self.gap} steps after the world settled",
                "save": f"{self.gap} steps after the world settled, {self.delay * 1000:.0f} ms "
                        "after a save request",
                "reform": f"{self.delay:.1f}s after the previous fault (re-forming)"}[self.timing]
        return ", ".join(parts) + "; " + when


# Steps a partition lets training run for each second it lasts (a slower machine only makes the
# tail longer). The job's workers are held to about this rate (SHARD_SLOW_STEP_MS): the tiny
# model trains hundreds of steps a second over shared memory or in a small world, and would run
# out of steps before the faults were all injected (the schedule's steps are budgeted at it).
PARTITION_STEPS_PER_SECOND = 50
STEP_FLOOR_MS = 1000 // PARTITION_STEPS_PER_SECOND

# Steps a fault costs besides its gap: training runs on while the script polls, calls shardctl,
# restarts the coordinator and waits for the world to settle (more on a fast machine, fewer on a
# loaded one). The default --steps allows this many per fault; Soak.fitted_gap measures it.
LATENCY_STEPS = 400


def tail_steps(args):
    """Steps left undisturbed at the end of the job."""
    return max(100, 20 * args.every)


def draw_kind_details(fault, args, rng):
    """The parameters of the kinds that draw their own (after the common ones, so that adding
    a kind leaves the schedules of the others as they were)."""
    if fault.kind == "partition":
        # Planned like resizes and drains: into a settled world, never during a re-formation.
        fault.timing = "save" if fault.timing == "save" else "steps"
        fault.variant = rng.choice(["pair", "worker", "coordinator"])
        fault.cut = rng.randint(1, max(1, args.workers - 1))
        # From shorter than a lease (TCP rides it out, or a re-formation follows) to 20 s (a
        # world re-forms without the hosts cut off, and folds them back in after the heal).
        fault.duration = rng.uniform(0.5 * args.lease, 20.0)
    if fault.kind == "disk":
        # Full for a few saves: they fail, the committed ones stay, and saves resume after.
        fault.timing = "save" if fault.timing == "save" else "steps"
        fault.duration = rng.uniform(1.0, 10.0)


def make_schedule(args, rng):
    kinds = (["kill"] * args.kills + ["stop"] * args.stops + ["coordinator"] * args.coordinator_kills
             + ["resize"] * args.resizes + ["drain"] * args.drains
             + ["partition"] * args.partitions + ["disk"] * args.disk_faults)
    rng.shuffle(kinds)
    lease, grace = args.lease, args.grace
    faults = []
    target = args.workers
    for i, kind in enumerate(kinds):
        fault = Fault(index=i + 1, kind=kind, pick=rng.random())
        roll = rng.random()
        # Planned reshapes need a settled world (this script counts its workers then); the
        # faults that follow them may still land in their pausing checkpoint.
        if i > 0 and kind in ("kill", "stop", "coordinator") and roll < 0.3:
            fault.timing = "reform"
            fault.delay = rng.uniform(0.05, lease + grace + 0.5)
        elif roll < 0.55:
            fault.timing = "save"
            fault.delay = rng.choice([0.0, rng.uniform(0.0, 0.05)])
        fault.replace = "now" if rng.random() < 0.6 else "late"
        fault.replace_delay = rng.uniform(lease + grace, 3 * (lease + grace)) \
            if fault.replace == "late" else 0.0
        fault.same_id = rng.random() < 0.5
        if kind == "stop":
            fault.then = "cont" if rng.random() < 0.5 else "kill"
            fault.stopped_for = rng.uniform(0.3 * lease, 3 * lease)
        if kind == "coordinator":
            fault.down_for = rng.choice([0.0, rng.uniform(0.1, 2 * lease)])
        if kind == "resize":
            sizes = [n for n in range(args.min_workers, args.workers + 1) if n != target]
            fault.size = rng.choice(sizes) if sizes else target
            target = fault.size
        if kind == "drain":
            fault.same_id = False
        draw_kind_details(fault, args, rng)
        faults.append(fault)
    # The faults that wait for training fire this many steps after the world settled again.
    for fault in faults:
        if fault.timing != "reform":
            fault.gap = rng.randint(1, 30 * args.every)
    return faults


# ----------------------------------------------------------------------------------------------
# The coordinator's metrics, polled in the background


class Monitor(threading.Thread):
    """Polls the coordinator's Prometheus endpoint: the latest sample, and when the step last
    changed. Starts no process (processes are started from the main thread only)."""

    FIELDS = {
        "shard_training_step": "step",
        "shard_generation": "generation",
        "shard_world_size": "world_size",
        "shard_world_ranks": "ranks",
        "shard_world_target_size": "target",
        'shard_workers{state="leaving"}': "leaving",
        'shard_workers{state="standby"}': "standby",
        'shard_job_state{state="running"}': "running",
    }

    # shard_worker_up{rank="R",worker="ID"}: labels in any order (prometheus-cpp sorts them).
    WORKER_UP = re.compile(r'shard_worker_up\{([^}]*)\}')
    LABEL = re.compile(r'(\w+)="([^"]*)"')

    def __init__(self, url, interval=0.2, netns=None):
        super().__init__(daemon=True)
        self.url, self.interval = url, interval
        self.netns = netns  # polls from inside this network namespace (the coordinator's host)
        self.lock = threading.Lock()
        self.last = None  # the latest sample: a dict, or None while the coordinator is down
        self.last_step = None
        self.last_change = time.time()
        self.progress_since_mark = 0  # steps gained since mark_action()
        self.stop_event = threading.Event()

    def mark(self):
        with self.lock:
            self.progress_since_mark = 0

    def run(self):
        if self.netns is not None:
            fault_hosts.enter_netns(self.netns)  # this thread only
        while not self.stop_event.wait(self.interval):
            sample = None
            try:
                with urllib.request.urlopen(self.url, timeout=1.0) as response:
                    text = response.read().decode()
                sample = {"ranks_by_worker": {}}
                for line in text.splitlines():
                    if line.startswith("#"):
                        continue
                    name, _, value = line.rpartition(" ")
                    if name in self.FIELDS:
                        sample[self.FIELDS[name]] = float(value)
                    up = self.WORKER_UP.fullmatch(name)
                    if up and float(value) == 1:
                        labels = dict(self.LABEL.findall(up.group(1)))
                        if "worker" in labels:
                            sample["ranks_by_worker"][labels["worker"]] = labels.get("rank", "")
            except Exception:  # the coordinator is down or restarting
                sample = None
            now = time.time()
            with self.lock:
                self.last = sample
                # A restarted coordinator reports step 0 until a worker reports again.
                if sample is not None and sample.get("step", 0) > 0:
                    step = int(sample["step"])
                    if step != self.last_step:
                        if self.last_step is not None and step > self.last_step:
                            self.progress_since_mark += step - self.last_step
                        elif self.last_step is not None:
                            self.progress_since_mark += 1  # a restore and a step: progress too
                        self.last_step = step
                        self.last_change = now

    def snapshot(self):
        with self.lock:
            return self.last, self.last_step, self.last_change, self.progress_since_mark


# ----------------------------------------------------------------------------------------------
# The soak


class Soak:
    def __init__(self, args, schedule):
        self.args = args
        self.faults = schedule
        self.bin = os.path.join(os.path.abspath(args.build_dir), "bin")
        for name in ("shard-coordinator", "shard-worker", "shardctl"):
            if not os.access(os.path.join(self.bin, name), os.X_OK):
                raise SoakFailure(f"{self.bin}/{name} is missing: build it first (scripts/build.sh "
                                  "--target shard-coordinator shard-worker shardctl)")
        base = args.dir or None
        self.dir = tempfile.mkdtemp(prefix="shard-soak.", dir=base)
        self.start_time = time.time()
        self.deadline = self.start_time + args.duration
        self.catalog = None  # the finished job's checkpoint catalog (verify_checkpoints)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SHARD_")}
        self.env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
        self.processes = Processes(self.dir, args.build_dir, env=self.env)
        self.workers = []  # every worker process ever started (see start_worker)
        self.coordinator = None
        self.coordinator_starts = 0
        self.port = 0
        self.metrics_port = 0
        self.monitor = None
        self.pending = []  # heap of (due, seq, what, fn)
        self.pending_seq = 0
        self.pending_starts = 0
        self.pending_resolutions = 0  # SIGSTOPped workers waiting for their CONT or KILL
        self.next_worker = args.workers
        self.incarnations = {}
        self.last_action = time.time()
        self.first_step = 0  # the step when the first fault was considered
        self.gaps_used = 0  # steps of the gaps so far (see fitted_gap)
        self.hangs = 0
        self.unexpected_exits = []  # (worker name, code, last line)
        self.counts = {"replaced_now": 0, "replaced_late": 0, "same_id": 0, "new_id": 0}
        self.notes = []
        self.failures = []
        self.finished = False
        self.results = {}
        # The coordinator's event history, read only through `shardctl events --json`:
        self.events_seen = {}  # sequence -> event, every event any read returned
        self.final_events = None  # the whole history at the end (None: not read)
        self.history_checks = 0  # coordinator restarts after which the history was compared
        self.events_before_kill = None  # read just before a coordinator fault's moment
        self.coordinator_restarts = 0
        # --partitions: the test hosts (the coordinator on "coord", workers on h1..hN), the
        # partitions in force, and those watched for standstills (until --partition-hang-after
        # after they heal).
        self.hosts = None
        self.disk_mounted = False  # --disk-faults: the checkpoint directory is a tmpfs of ours
        self.address = "127.0.0.1"  # the coordinator's host's address
        self.partitions_in_force = 0
        self.watched_partitions = []

    # -- output --------------------------------------------------------------------------------

    def say(self, message):
        print(f"[{time.time() - self.start_time:7.1f}s] {message}", flush=True)

    # -- processes -----------------------------------------------------------------------------

    def path(self, *parts):
        return os.path.join(self.dir, *parts)

    def prefix(self, host=None):
        """What runs a program of the soak: it dies with this script even if the script is
        SIGKILLed (PR_SET_PDEATHSIG; the signal goes when the thread that started it ends:
        every process is started from the main thread), and with `host` (--partitions) it runs
        on that test host. Both exec the program in place, so its pid is the one signalled."""
        prefix = ["setpriv", "--pdeathsig", "KILL", "--"] if shutil.which("setpriv") else []
        return prefix + (self.hosts.argv(host, []) if host is not None else [])

    def shardctl(self, *argv, timeout=15, port=None):
        """shardctl against the coordinator (or the one on `port` on this machine's loopback);
        (exit status, stdout, stderr), never raises. With --partitions it runs on the
        coordinator's host."""
        address = f"127.0.0.1:{port}" if port else f"{self.address}:{self.port}"
        command = [os.path.join(self.bin, "shardctl"), "--coordinator", address,
                   "--timeout", "5s", *argv]
        if not port and self.hosts is not None:
            command = self.hosts.argv("coord", command)
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                                    env=self.env, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return 124, "", f"shardctl {' '.join(argv)}: no answer within {timeout}s"
        return result.returncode, result.stdout, result.stderr

    def tool(self, *argv, timeout=60):
        """shardctl without a coordinator (data, checkpoint --path, compare)."""
        try:
            result = subprocess.run([os.path.join(self.bin, "shardctl"), *argv],
                                    capture_output=True, text=True, timeout=timeout, env=self.env,
                                    stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return 124, "", f"shardctl {' '.join(argv)}: not done within {timeout}s"
        return result.returncode, result.stdout, result.stderr

    def status(self):
        """`shardctl status --json`, parsed (three tries); None if the coordinator does not
        answer."""
        for attempt in range(3):
            code, out, _ = self.shardctl("status", "--json", timeout=10)
            if code == 0:
                try:
                    return json.loads(out)
                except ValueError:
                    pass
            time.sleep(0.2)
        return None

    # -- history: the event log and the checkpoint catalog, through shardctl only -------------

    EVENT_KEY = ("sequence", "generation", "kind", "worker_id", "rank", "detail")

    def read_events(self, port=None, tries=3):
        """`shardctl events --json` (one object per line), oldest first; None if the coordinator
        did not answer. Every event read is remembered (by sequence) in events_seen."""
        for attempt in range(tries):
            if attempt:
                time.sleep(0.3)
            code, out, _ = self.shardctl("events", "--json", port=port, timeout=15)
            if code != 0:
                continue
            try:
                events = [json.loads(line) for line in out.splitlines() if line.strip()]
            except ValueError:
                continue
            if port is None:
                for event in events:
                    self.events_seen.setdefault(event["sequence"], event)
            return events
        return None

    def read_catalog(self, port=None):
        """`shardctl checkpoint list --json`: the committed checkpoints; None without an
        answer."""
        for attempt in range(3):
            if attempt:
                time.sleep(0.3)
            code, out, _ = self.shardctl("checkpoint", "list", "--json", port=port, timeout=15)
            if code == 0:
                try:
                    return json.loads(out)
                except ValueError:
                    pass
        return None

    # The coordinator keeps its latest 1000 events (WorldOptions::max_events); older ones go.
    EVENTS_KEPT = 1000

    def lost_events(self, before, after):
        """The events of `before` that `after` no longer lists as they were. Once `after` holds
        as many events as the coordinator keeps, those before its first may have gone."""
        now = {e["sequence"]: e for e in after}
        first = min(now) if len(now) >= self.EVENTS_KEPT else 1
        key = lambda e: tuple(e.get(k) for k in self.EVENT_KEY)  # noqa: E731
        return [e for e in before
                if e["sequence"] >= first and (e["sequence"] not in now
                                               or key(now[e["sequence"]]) != key(e))]

    def check_history_kept(self, before, why):
        """After a coordinator restart: every event listed before it is listed again, with the
        same sequence number (the event log is persisted in the state directory)."""
        if before is None:
            self.say(f"event history not compared {why}: it could not be read before")
            return
        after = self.read_events(tries=10)
        if after is None:
            self.failures.append(f"shardctl events did not answer {why}")
            return
        lost = self.lost_events(before, after)
        self.history_checks += 1
        if lost:
            self.failures.append(f"the event history lost {len(lost)} of {len(before)} events "
                                 f"{why}, e.g. {json.dumps(lost[0])}")
            self.say(f"FAILED: {self.failures[-1]}")
        else:
            self.say(f"event history kept {why}: {len(before)} events before, {len(after)} now")

    def inspect_state(self):
        """The finished job's whole event history and checkpoint catalog. Its coordinator exits
        once the job finishes, so another is started, with no workers, on a copy of the state
        directory (the run's own stays as it was left) and asked with shardctl. A finished job
        is not taken back, so it gets a job spec: the same job, with its checkpoint directory
        pointing at an empty folder (the start-up cleaning of uncommitted checkpoints then
        touches nothing of the run's). Returns (events, catalog, forgotten): `forgotten` are
        the catalog entries the new coordinator dropped because their directory has no
        manifest (it logs them), which count as checkpoints that do not verify."""
        work = self.path("inspect")
        state = os.path.join(work, "state")
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(self.path("state"), state, ignore=shutil.ignore_patterns("LOCK"))
        job = self.write_job("job-inspect", self.args.workers, self.args.min_workers, 0,
                             os.path.join(work, "out"), os.path.join(work, "checkpoints"),
                             self.args.keep_last)
        started_ms = time.time() * 1000
        try:
            coordinator = self.processes.start_coordinator(
                "--lease", "60s", "--reform-grace", "60s", job=job, state_dir=state,
                name="inspect-coordinator", log=os.path.join(work, "coordinator.log"),
                timeout=20, cwd=work, prefix=self.prefix())
        except ProcessError as error:
            self.failures.append("could not read the history: a coordinator on a copy of the "
                                 f"state did not start: {error}")
            return None, None, []
        try:
            events = self.read_events(port=coordinator.port)
            catalog = self.read_catalog(port=coordinator.port)
        finally:
            coordinator.kill()
        forgotten = re.findall(r"checkpoint (\S+) is in the catalog but (\S+) has no manifest",
                               coordinator.log())
        if events is None or catalog is None:
            self.failures.append("could not read the history: shardctl events/checkpoint list "
                                 "did not answer")
        else:
            # Its own start ("coordinator_started") is not the run's.
            events = [e for e in events if e.get("unix_ms", 0) < started_ms]
        return events, catalog, forgotten

    def start_coordinator(self):
        """Starts the coordinator on self.port (0 the first time) and waits for it to serve;
        False if it did not come up (the port taken, ...)."""
        self.coordinator_starts += 1
        try:
            self.coordinator = self.processes.start_coordinator(
                "--metrics-listen", f"{self.address}:{self.metrics_port}", *self.coordinator_args,
                job=self.job, state_dir=self.path("state"), listen=f"{self.address}:{self.port}",
                log=f"coordinator-{self.coordinator_starts}.log", timeout=20, cwd=self.dir,
                prefix=self.prefix("coord" if self.hosts else None))
        except ProcessError as error:
            self.notes.append(f"coordinator start {self.coordinator_starts} failed: {error}")
            return False
        self.port = self.coordinator.port
        self.last_action = time.time()
        return True

    def worker_host(self):
        """The worker host with the fewest live workers (the first such): a replacement takes
        the host its predecessor left."""
        if self.hosts is None:
            return None
        names = [n for n in self.hosts.names if n != "coord"]
        live = [w.host for w in self.live_workers() if not w.leaving]
        return min(names, key=lambda n: (live.count(n), names.index(n)))

    def start_worker(self, worker_id):
        n = self.incarnations.get(worker_id, 0) + 1
        self.incarnations[worker_id] = n
        host = self.worker_host()
        flags = ["--compute-threads", "1"]
        if host is not None:
            flags += ["--host", self.hosts.addr(host)]
        worker = self.processes.start_worker(
            worker_id, f"{self.address}:{self.port}", *flags, *self.args.worker_arg,
            name=f"{worker_id}#{n}", log=os.path.join("workers", f"{worker_id}-{n}.log"),
            env={"SHARD_SLOW_STEP_MS": str(STEP_FLOOR_MS)}, cwd=self.dir,
            prefix=self.prefix(host))
        # What the soak keeps of each worker beside its process:
        worker.id = worker_id
        worker.host = host  # the test host it runs on (--partitions), else None
        worker.stopped = False  # SIGSTOPped (and not yet resolved)
        worker.leaving = False  # drained: on its way out
        worker.resolved = False  # its exit (or kill) has been accounted for
        self.workers.append(worker)
        self.last_action = time.time()
        return worker

    def new_worker_id(self):
        worker_id = f"w{self.next_worker}"
        self.next_worker += 1
        return worker_id

    def live_workers(self):
        """Worker processes running (SIGSTOPped ones included) that this script did not kill."""
        return [w for w in self.workers if w.alive() and not w.killed]

    # -- the main loop's pump: due actions, exits, the hang detector, the deadline ------------

    def later(self, delay, what, fn):
        self.pending_seq += 1
        heapq.heappush(self.pending, (time.time() + delay, self.pending_seq, what, fn))

    def run_due(self):
        while self.pending and self.pending[0][0] <= time.time():
            _, _, _, fn = heapq.heappop(self.pending)
            fn()

    def reap(self):
        for worker in self.workers:
            if worker.resolved or worker.poll() is None:
                continue
            worker.resolved = True
            if worker.killed:
                continue
            text = worker.log()
            code = worker.returncode
            lines = [line for line in text.splitlines() if line.strip()]
            last = lines[-1] if lines else "(empty log)"
            if code == 0:
                if "ordered a stop: resized out" in text or "ordered a stop: drained" in text:
                    self.say(f"{worker.name} left as told: {last[24:]}")
                    continue
                if "training finished" in text or "ordered a stop" in text:
                    continue
                self.say(f"{worker.name} exited 0 unexpectedly: {last}")
                self.unexpected_exits.append((worker.name, code, last))
            elif "is stopping (training finished" in text:
                # Joined (a replacement, or a resumed worker) just as the job finished.
                self.say(f"{worker.name} was refused: the job had finished")
                continue
            else:
                self.say(f"UNEXPECTED: worker {worker.name} exited with status {code}: {last}")
                self.unexpected_exits.append((worker.name, code, last))
            if self.finished or self.coordinator_finished():
                continue
            # As an orchestrator would: start it again (same id) after a back-off.
            self.schedule_start(worker.id, self.args.lease + self.args.grace + 1.0,
                                "restart of a worker that exited")

    def coordinator_finished(self):
        return (self.coordinator is not None and self.coordinator.poll() is not None
                and not self.coordinator.killed)

    def check_hang(self, context):
        _, step, changed, _ = self.monitor.snapshot()
        now = time.time()
        # From a partition's start until --partition-hang-after after it healed, training may
        # stand still (the link is down, a world re-forms without the hosts cut off, folds them
        # back in) but never for longer than --partition-hang-after.
        for fault in list(self.watched_partitions):
            quiet = now - max(changed, fault.fired_at)
            fault.longest_quiet = max(fault.longest_quiet, quiet)
            if quiet > self.args.partition_hang_after:
                self.hangs += 1
                raise Hang(f"no training progress for {quiet:.1f}s after partition fault "
                           f"{fault.index} ({fault.what}); last step {step}")
            healed = fault.fired_at + fault.duration
            if fault.healed and now > healed + self.args.partition_hang_after:
                self.watched_partitions.remove(fault)
        bound = self.args.hang_after
        if self.watched_partitions:
            bound = max(bound, self.args.partition_hang_after)
        quiet_since = max(changed, self.last_action)
        if now - quiet_since > bound:
            self.hangs += 1
            raise Hang(f"no training progress for {now - quiet_since:.1f}s (bound "
                       f"{bound:.0f}s) while {context}; last step {step}")

    def pump(self, until, timeout, context, hang_check=True):
        """Runs the loop until `until()` holds; False after `timeout` seconds."""
        give_up = time.time() + timeout
        while True:
            self.run_due()
            self.reap()
            if until():
                return True
            if self.coordinator is not None and self.coordinator.poll() is not None \
                    and not self.coordinator.killed:
                return until()
            if hang_check:
                self.check_hang(context)
            if time.time() > self.deadline:
                raise SoakFailure(f"--duration {self.args.duration:.0f}s ran out while {context}")
            if time.time() > give_up:
                return False
            time.sleep(0.05)

    def sleep(self, seconds, context):
        end = time.time() + seconds
        self.pump(lambda: time.time() >= end, seconds + 1, context)

    # -- set-up --------------------------------------------------------------------------------

    def write_job(self, name, world, min_world, every, out, checkpoints, keep_last):
        path = self.path(f"{name}.json")
        batch = math.lcm(*range(1, world + 1))
        batch *= max(1, math.ceil(96 / batch))
        job = {
            "name": "soak", "worldSize": world, "minWorldSize": min_world,
            "model": {"mlp": {"widths": [32, 64, 10]}},
            "data": {"path": self.path("data.safetensors")},
            "seed": 11, "optimizer": {"name": "adam", "lr": 0.002}, "globalBatch": batch,
            "steps": self.args.steps, "zeroStage": 2, "bucketCapMb": 0.004,
            "checkpoint": {"dir": checkpoints, "everySteps": every, "keepLast": keep_last},
            # Off by default: every recovery restores a disk checkpoint, the reference this
            # script compares with. --snapshot-every: recoveries from memory where a snapshot
            # holds every range (the reference restores the disk checkpoint of that step).
            "snapshot": {"everySteps": self.args.snapshot_every, "replicas": 1},
            "outputDir": out,
        }
        with open(path, "w") as handle:
            json.dump(job, handle, indent=2)
        return path

    def set_up(self):
        os.makedirs(self.path("workers"))
        if self.args.disk_faults:
            # A disk of its own, so that filling it touches nothing else (and saves hit ENOSPC).
            os.makedirs(self.path("checkpoints"))
            mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs",
                                      self.path("checkpoints")], capture_output=True, text=True)
            if mounted.returncode != 0:
                raise SoakFailure(f"cannot mount the checkpoint disk: {mounted.stderr.strip()}")
            self.disk_mounted = True
        code, out, err = self.tool("data", "generate", "--widths", "32,64,10", "--samples", "4096",
                                   "--seed", "9", "--out", self.path("data.safetensors"))
        if code != 0:
            raise SoakFailure(f"shardctl data generate failed: {err}")
        self.job = self.write_job("job", self.args.workers, self.args.min_workers, self.args.every,
                                  self.path("out"), self.path("checkpoints"), self.args.keep_last)
        self.coordinator_args = ["--lease", duration_flag(self.args.lease),
                                 "--reform-grace", duration_flag(self.args.grace)]
        if self.args.partitions:
            # A host for the coordinator and one per worker slot (a host may hold two workers
            # for a moment: a drained one leaving and its replacement).
            self.hosts = fault_hosts.Hosts(["coord"] + [f"h{i + 1}" for i in
                                                        range(self.args.workers)],
                                           log=self.say)
            try:
                self.hosts.up()
            except RuntimeError as error:
                raise SoakFailure(f"the test hosts did not come up: {error}")
            self.address = self.hosts.addr("coord")
        for attempt in range(3):
            self.metrics_port = free_port()
            self.port = 0
            if self.start_coordinator():
                break
        else:
            raise SoakFailure("the coordinator did not start:\n" + "\n".join(self.notes))
        self.monitor = Monitor(f"http://{self.address}:{self.metrics_port}/metrics",
                               netns=self.hosts.ns("coord") if self.hosts else None)
        self.monitor.start()
        self.say(f"coordinator on {self.address}:{self.port} (metrics :{self.metrics_port}), "
                 f"starting {self.args.workers} workers"
                 + (" on hosts h1..h{}".format(self.args.workers) if self.hosts else ""))
        for i in range(self.args.workers):
            self.start_worker(f"w{i}")

    # -- faults --------------------------------------------------------------------------------

    def schedule_start(self, worker_id, delay, why):
        self.pending_starts += 1

        def start():
            self.pending_starts -= 1
            if self.coordinator_finished():
                return
            self.start_worker(worker_id)
            if delay > 0:
                self.say(f"started {worker_id} ({why})")
        if delay <= 0:
            start()
        else:
            self.later(delay, f"start {worker_id}", start)

    def replace(self, fault, victim_id):
        worker_id = victim_id if fault.same_id else self.new_worker_id()
        self.counts["same_id" if fault.same_id else "new_id"] += 1
        if fault.replace == "now":
            self.counts["replaced_now"] += 1
            self.schedule_start(worker_id, 0, f"replacement for {victim_id}, at once")
        else:
            self.counts["replaced_late"] += 1
            self.schedule_start(worker_id, fault.replace_delay,
                                f"replacement for {victim_id}, {fault.replace_delay:.1f}s late")
        return worker_id

    def pick(self, fault, candidates):
        candidates = sorted(candidates, key=lambda w: (int(w.id[1:]) if w.id[1:].isdigit() else 0,
                                                       w.id))
        return candidates[min(len(candidates) - 1, int(fault.pick * len(candidates)))]

    def rank_of(self, worker_id):
        """From the latest metrics: "rank R", "standby", or "?" (not live there)."""
        sample = self.monitor.snapshot()[0] or {}
        rank = sample.get("ranks_by_worker", {}).get(worker_id)
        if rank is None:
            return "?"
        return f"rank {rank}" if rank else "standby"

    def kill_worker(self, worker):
        worker.kill()

    def inject_partition(self, fault):
        """Drops every packet between hosts (iptables in their namespaces) and heals after
        fault.duration: two workers' hosts from each other, one worker's host from every peer
        (it still reaches the coordinator), or the coordinator's host from fault.cut of the
        workers' hosts. Returns what it did, or "" with fault.skipped set."""
        hosts = sorted({w.host for w in self.live_workers() if not w.stopped},
                       key=lambda h: int(h[1:]))
        at = min(len(hosts) - 1, int(fault.pick * len(hosts))) if hosts else 0
        if fault.variant == "pair":
            if len(hosts) < 2:
                fault.skipped = "fewer than two hosts with running workers"
                return ""
            a, b = hosts[at], hosts[(at + 1) % len(hosts)]
            self.hosts.partition(a, b)
            cut, what = [(a, b)], f"partition {a} <-/-> {b}"
        elif fault.variant == "worker":
            if not hosts:
                fault.skipped = "no host with a running worker"
                return ""
            others = [h for h in self.hosts.names if h not in ("coord", hosts[at])]
            self.hosts.isolate(hosts[at], except_=["coord"])
            cut, what = [(hosts[at], o) for o in others], f"partition {hosts[at]} from its peers"
        else:
            if not hosts:
                fault.skipped = "no host with a running worker"
                return ""
            chosen = [hosts[(at + i) % len(hosts)] for i in range(min(fault.cut, len(hosts)))]
            for host in chosen:
                self.hosts.partition("coord", host)
            cut, what = [("coord", h) for h in chosen], f"partition coord from {', '.join(chosen)}"
        on = {h: sorted(w.id for w in self.live_workers() if w.host == h) for h in hosts}
        what += " (" + "; ".join(f"{h}: {', '.join(ids)}" for h, ids in on.items() if ids) + ")"
        self.partitions_in_force += 1
        self.watched_partitions.append(fault)

        def heal():
            for a, b in cut:
                self.hosts.heal(a, b)
            self.partitions_in_force -= 1
            fault.healed = True
            self.say(f"healed fault {fault.index} after {fault.duration:.1f}s")
        self.later(fault.duration, f"heal fault {fault.index}", heal)
        return what + f" for {fault.duration:.1f}s"

    def inject_disk(self, fault):
        """Fills the checkpoint disk (a tmpfs of its own) to the last byte and frees it after
        fault.duration: the saves meanwhile fail with ENOSPC, and training must go on."""
        filler = os.path.join(self.path("checkpoints"), f".filler-{fault.index}")
        written = 0
        # Unbuffered writes: a buffered file's close flushes what the full disk refused and
        # raises ENOSPC again. Shrinking sizes fill the last bytes too.
        descriptor = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for size in (1 << 16, 4096, 512, 1):
                chunk = b"\0" * size
                while True:
                    try:
                        written += os.write(descriptor, chunk)
                    except OSError as error:
                        if error.errno != errno.ENOSPC:
                            raise
                        break
        finally:
            os.close(descriptor)

        def free():
            os.remove(filler)
            self.say(f"freed the checkpoint disk after {fault.duration:.1f}s (fault {fault.index})")
        self.later(fault.duration, f"free the disk of fault {fault.index}", free)
        return f"checkpoint disk full ({written >> 20} MiB written) for {fault.duration:.1f}s"

    def inject(self, fault):
        step = self.monitor.snapshot()[1]
        fault.fired_at = time.time()
        self.last_action = time.time()
        runnable = [w for w in self.live_workers() if not w.stopped]
        if fault.kind == "partition":
            fault.what = self.inject_partition(fault)
            if fault.skipped:
                return
        elif fault.kind == "disk":
            fault.what = self.inject_disk(fault)
        elif fault.kind in ("kill", "stop"):
            if not runnable:
                fault.skipped = "no running worker"
                return
            victim = self.pick(fault, runnable)
            where = self.rank_of(victim.id)
            if fault.kind == "kill":
                self.kill_worker(victim)
                replacement = self.replace(fault, victim.id)
                fault.what = f"SIGKILL {victim.name} ({where}); replacement {replacement}"
            else:
                victim.stopped = True
                victim.signal(signal.SIGSTOP)
                self.pending_resolutions += 1
                fault.what = f"SIGSTOP {victim.name} ({where}) for {fault.stopped_for:.1f}s"

                def resolve(victim=victim, fault=fault):
                    self.pending_resolutions -= 1
                    victim.stopped = False
                    if fault.then == "cont":
                        victim.signal(signal.SIGCONT)
                        self.say(f"SIGCONT {victim.name} after {fault.stopped_for:.1f}s")
                    else:
                        self.kill_worker(victim)
                        replacement = self.replace(fault, victim.id)
                        self.say(f"SIGKILL {victim.name} after {fault.stopped_for:.1f}s stopped; "
                                 f"replacement {replacement} {fault.replace}")
                    self.last_action = time.time()
                self.later(fault.stopped_for, f"resolve stop of {victim.name}", resolve)
        elif fault.kind == "coordinator":
            if not self.coordinator.alive():
                fault.skipped = "the coordinator is not running"
                return
            self.coordinator.kill()
            fault.what = f"SIGKILL the coordinator; restart after {fault.down_for:.1f}s"
            self.say(f"fault {fault.index}: {fault.what} (step {step}, {fault.timing})")
            self.sleep(fault.down_for, "the coordinator is down")
            for attempt in range(5):
                if self.start_coordinator():
                    break
                time.sleep(0.5)
            else:
                raise SoakFailure("the coordinator did not come back on port "
                                  f"{self.port}:\n" + "\n".join(self.notes[-2:]))
            recovered = "(kept)" in self.coordinator.log() and "generation" in self.coordinator.log()
            self.say(f"coordinator restarted on {self.address}:{self.port}"
                     + (" (world kept)" if recovered else ""))
            self.coordinator_restarts += 1
            self.check_history_kept(self.events_before_kill,
                                    f"across coordinator restart {self.coordinator_restarts}")
            self.events_before_kill = None
            self.last_action = time.time()
            return
        elif fault.kind == "resize":
            code, out, err = self.shardctl("resize", "--world-size", str(fault.size), "--no-wait")
            if code != 0:
                fault.skipped = f"refused: {err.strip()}"
                return
            fault.what = f"shardctl resize --world-size {fault.size}"
            # Growing needs workers: start new ones, which wait as standbys until folded in.
            status = self.status() or {}
            holding = [w for w in status.get("workers", [])
                       if w.get("state") in ("joining", "ready", "standby", "failed")]
            need = fault.size - len(holding) - self.pending_starts
            room = self.args.workers - len(self.live_workers()) - self.pending_starts
            for _ in range(max(0, min(need, room))):
                self.schedule_start(self.new_worker_id(), 0, f"to grow to {fault.size}")
        elif fault.kind == "drain":
            status = self.status() or {}
            ranked = [w for w in status.get("workers", [])
                      if w.get("rank", -1) >= 0 and w.get("state") in ("joining", "ready")]
            standbys = sum(1 for w in status.get("workers", []) if w.get("state") == "standby")
            by_id = {w.id: w for w in self.live_workers()}
            ranked = [by_id[w["id"]] for w in ranked if w["id"] in by_id]
            if not ranked:
                fault.skipped = "no worker holds a rank"
                return
            victim = self.pick(fault, ranked)
            if len(ranked) - 1 < self.args.min_workers and standbys == 0:
                # The coordinator refuses a drain below min_world_size without a standby:
                # start the replacement first and let it wait as a standby.
                self.schedule_start(self.new_worker_id(), 0, "a standby before a drain")
                self.pump(lambda: (self.monitor.snapshot()[0] or {}).get("standby", 0) > 0, 20,
                          "waiting for a standby before a drain")
                replace_after = False
            else:
                replace_after = True
            code, out, err = self.shardctl("drain", victim.id, "--no-wait")
            if code != 0:
                fault.skipped = f"refused: {err.strip()}"
                return
            victim.leaving = True  # its host is free for the replacement
            fault.what = f"shardctl drain {victim.name} ({self.rank_of(victim.id)})"
            if replace_after:
                replacement = self.replace(fault, victim.id)
                fault.what += f"; replacement {replacement}"
        self.say(f"fault {fault.index}: {fault.what} (step {step}, {fault.timing})")

    def recovered(self):
        """Settled enough for the next planned fault: the coordinator serves a running world
        with every rank held, nobody leaving, no stopped worker, and training went on for more
        than a checkpoint interval since the last action."""
        sample, step, _, progress = self.monitor.snapshot()
        return (sample is not None and self.coordinator.alive()
                and sample.get("running") == 1 and sample.get("world_size") == sample.get("ranks")
                and sample.get("leaving", 0) == 0 and self.pending_resolutions == 0
                and self.partitions_in_force == 0 and progress > self.args.every)

    def fitted_gap(self, fault, step):
        """The fault's gap, shortened if the steps left would not hold the faults still to
        come. Besides the gaps, each fault costs steps that training runs on while the script
        polls, calls shardctl, restarts the coordinator and waits for the world to settle;
        that cost is measured over the faults so far."""
        timed = [f for f in self.faults if f.timing != "reform"]
        done = [f for f in timed if f.fired_at is not None]
        left = len(timed) - len(done)
        overhead = LATENCY_STEPS
        if done:
            overhead = (step - self.first_step - self.gaps_used) / len(done)
        room = self.args.steps - step - tail_steps(self.args)
        fair = int(room / max(1, left) - max(overhead, self.args.every + 1))
        gap = max(1, min(fault.gap, fair))
        self.gaps_used += gap
        return gap

    def run_faults(self):
        self.say("waiting for the world to form and commit its first checkpoints")
        if not self.pump(lambda: (self.monitor.snapshot()[1] or 0) > 2 * self.args.every + 1,
                         self.args.hang_after + 60, "the first world forms"):
            raise Hang("training did not start")
        self.first_step = self.monitor.snapshot()[1]
        self.gaps_used = 0
        for fault in self.faults:
            if self.coordinator_finished():
                break
            if fault.timing == "reform":
                began = time.time()
                self.before_fault(fault)
                self.sleep(max(0.0, fault.delay - (time.time() - began)),
                           f"waiting to inject fault {fault.index} during re-formation")
            else:
                self.monitor.mark()
                self.pump(self.recovered, 1e9, f"waiting for the world to settle before fault "
                          f"{fault.index}")
                settled = self.monitor.snapshot()[1] or 0
                gap = self.fitted_gap(fault, settled)
                self.pump(lambda: (self.monitor.snapshot()[1] or 0) >= settled + gap, 1e9,
                          f"waiting for step {settled + gap} for fault {fault.index}")
                if self.coordinator_finished():
                    break
                self.before_fault(fault)
                if fault.timing == "save":
                    self.shardctl("checkpoint", "save", "--no-wait", timeout=10)
                    if fault.delay > 0:
                        time.sleep(fault.delay)
            self.inject(fault)
            self.monitor.mark()
        done = [f for f in self.faults if f.fired_at is not None]
        if len(done) < len(self.faults):
            self.check_the_coordinator_finished()
            raise SoakFailure(f"the job finished after {len(done)} of {len(self.faults)} faults; "
                              "give it more --steps")

    def before_fault(self, fault):
        """Before a coordinator kill's moment (not in it: the read takes a shardctl call), the
        event history it must keep."""
        if fault.kind == "coordinator" and self.coordinator.alive():
            self.events_before_kill = self.read_events()

    def check_the_coordinator_finished(self):
        """The coordinator exited on its own: it must have finished the job and exited 0."""
        code = self.coordinator.wait(30)
        if code != 0 or "training finished (" not in self.coordinator.log():
            raise SoakFailure(f"the coordinator exited with status {code} without finishing the "
                              f"job:\n{self.coordinator.tail(20)}")

    def wait_for_the_end(self):
        self.say("every fault injected; waiting for the job to finish")
        self.monitor.mark()
        self.pump(lambda: self.coordinator.poll() is not None and not self.pending, 1e9,
                  "waiting for the job to finish")
        self.check_the_coordinator_finished()
        self.finished = True
        self.end_time = time.time()
        self.say("the job finished; the coordinator exited 0")
        for worker in self.live_workers():
            if worker.stopped:
                worker.signal(signal.SIGCONT)
            if worker.wait(max(1.0, min(30.0, self.deadline - time.time()))) is None:
                self.failures.append(f"{worker.name} did not exit after the job finished")
                worker.signal(signal.SIGKILL)
                worker.wait(5)
        self.reap()

    # -- diagnostics ---------------------------------------------------------------------------

    def dump(self, why):
        print(f"\n==== {why}", flush=True)
        if self.coordinator is not None and self.coordinator.alive():
            for argv in (["status"], ["events"]):
                code, out, err = self.shardctl(*argv, timeout=15)
                text = out if code == 0 else err
                lines = text.splitlines()
                print(f"---- shardctl {' '.join(argv)}" + (" (last 40)" if len(lines) > 40 else ""))
                print("\n".join(lines[-40:]))
        if self.hosts is not None:
            print("---- test hosts (scripts/fault-hosts.sh faults)")
            print(self.hosts.faults().rstrip())
        if self.coordinator is not None:
            print(f"---- {os.path.relpath(self.coordinator.log_path, self.dir)} (last 30 lines)")
            print(self.coordinator.tail(30))
        for worker in self.workers:
            state = "running" if worker.alive() else f"exited {worker.returncode}"
            if worker.killed:
                state = "killed by the soak"
            if worker.stopped:
                state += ", SIGSTOPped"
            lines = 12 if worker.alive() else 3
            print(f"---- {os.path.relpath(worker.log_path, self.dir)} ({state}; last {lines} lines)")
            print(worker.tail(lines))
        print("====", flush=True)

    # -- checks at the end ---------------------------------------------------------------------

    def verify_checkpoints(self):
        """Every checkpoint of the finished job's catalog (`shardctl checkpoint list --json`)
        verifies (`shardctl checkpoint verify --path DIR`); also reads the whole event history
        and checks it still holds every event read during the run."""
        events, catalog, forgotten = self.inspect_state()
        if events is not None:
            self.final_events = events
            lost = self.lost_events(sorted(self.events_seen.values(),
                                           key=lambda e: e["sequence"]), events)
            if lost:
                self.failures.append(f"the final event history lost {len(lost)} events read "
                                     f"during the run, e.g. {json.dumps(lost[0])}")
        kept = catalog or []
        self.catalog = kept

        def verify(record):
            code, out, err = self.tool("checkpoint", "verify", "--path", record["dir"], "--json")
            try:
                if code == 0 and json.loads(out).get("ok", False):
                    return None
            except ValueError:
                pass
            return f"{record['id']}: {(err or out).strip()[:200]}"
        # shardctl processes only, each with a timeout; a few at a time.
        with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
            damaged = [d for d in pool.map(verify, kept) if d is not None]
        verified = len(kept) - len(damaged)
        damaged += [f"{cid}: in the catalog, but {where} has no manifest"
                    for cid, where in forgotten]
        self.results["kept"] = len(kept) + len(forgotten)
        self.results["verified"] = verified
        if catalog is not None and not kept:
            self.failures.append("no checkpoint in the catalog")
        for line in damaged:
            self.failures.append(f"checkpoint does not verify: {line}")
        self.say(f"checkpoints: {verified} of {self.results['kept']} kept verify")

    def restore_counts(self):
        """How the generations that restored did it: from memory snapshots or from disk."""
        restores = set()
        for worker in self.workers:
            for line in worker.log().splitlines():
                generation = re.search(r" gen=(\d+) ", line)
                if generation is None:
                    continue
                if "restoring from memory snapshot " in line:
                    restores.add((generation.group(1), "memory"))
                elif "restoring from checkpoint " in line:
                    restores.add((generation.group(1), "disk"))
        kinds = [kind for _, kind in restores]
        return f"from memory {kinds.count('memory')}, from disk {kinds.count('disk')}"

    def final_segment(self):
        """(restore or None, world size) of the last stretch of training: the workers that
        finished, and the last restore they made, ("checkpoint", id) or ("memory", id, step)."""
        finished = [w for w in self.workers if "training finished:" in w.log()]
        restores = []
        for worker in finished:
            last = None
            for line in worker.log().splitlines():
                disk = re.search(r"restoring from checkpoint (\S+)", line)
                memory = re.search(r"restoring from memory snapshot (\S+) \(step (\d+)\)", line)
                if disk:
                    last = ("checkpoint", disk.group(1))
                elif memory:
                    last = ("memory", memory.group(1), int(memory.group(2)))
            restores.append(last)
        if len(set(restores)) > 1:
            self.failures.append(f"the final world's workers restored different states last: "
                                 f"{sorted(set(str(r) for r in restores))}")
        return (restores[0] if restores else None), len(finished)

    def reference_run(self, label, job, state_dir, world, extra, out_file):
        """A job without faults: a coordinator (`extra` flags) and `world` workers; True if it
        finished and wrote `out_file`."""
        run_dir = self.path(label)
        os.makedirs(run_dir, exist_ok=True)
        started = time.time()
        try:
            coordinator = self.processes.start_coordinator(
                "--lease", duration_flag(max(self.args.lease, 2.0)), "--reform-grace", "5s",
                *extra, job=job, state_dir=state_dir, name=f"{label}-coordinator",
                log=os.path.join(run_dir, "coordinator.log"), timeout=20, cwd=run_dir,
                prefix=self.prefix())
        except ProcessError as error:
            self.failures.append(f"{label}: the coordinator did not start: {error}")
            return None
        workers = [self.processes.start_worker(f"{label}{i}", coordinator.address,
                                               "--compute-threads", "1",
                                               log=os.path.join(run_dir, f"{label}{i}.log"),
                                               cwd=run_dir, prefix=self.prefix())
                   for i in range(world)]
        budget = max(10.0, self.deadline - time.time())
        code = coordinator.wait(budget)
        if code is None:
            self.failures.append(f"{label}: the run did not finish within the --duration left")
            return None
        for worker in workers:
            if worker.wait(20) is None:
                worker.signal(signal.SIGKILL)
        if code != 0 or not os.path.exists(out_file):
            self.failures.append(f"{label}: the coordinator exited {code}:\n"
                                 + coordinator.tail(10))
            return None
        return time.time() - started

    def compare(self, a, b):
        code, out, err = self.tool("compare", a, b, "--json")
        try:
            return json.loads(out)["max_abs_diff"]
        except (ValueError, KeyError):
            return f"compare failed: {(err or out).strip()[:200]}"

    def check_parameters(self):
        final = self.path("out", "final.safetensors")
        if not os.path.exists(final):
            self.failures.append("the job wrote no out/final.safetensors")
            return
        restore, world = self.final_segment()
        self.results["final_world"] = world
        checkpoint = restore[1] if restore is not None and restore[0] == "checkpoint" else None
        self.results["restored"] = checkpoint
        if world < 1:
            self.failures.append("no worker logged 'training finished'")
            return
        if restore is not None and restore[0] == "memory":
            # A snapshot and the checkpoint saved at the same boundary share their id (step and
            # generation): the same state, whichever way it was kept.
            _, snapshot, step = restore
            self.results["restored"] = f"memory snapshot {snapshot} (step {step})"
            if not any(r["id"] == snapshot for r in (self.catalog or [])):
                # The save of that step was skipped (the one before still writing) or pruned.
                self.results["reference_equal"] = None
                self.results["reference_missing"] = (f"no disk checkpoint {snapshot}, saved with "
                                                     "the snapshot, to compare with")
                self.say(f"reference: not run: {self.results['reference_missing']}")
                return
            checkpoint = snapshot
            self.results["restored"] += ", compared with the disk checkpoint of that id"
        scratch_state = self.path("state-scratch")
        if checkpoint is not None:
            # A copy of the catalog (the job's own state directory stays as the run left it):
            # the new run restores the same checkpoint from the same directory.
            state = self.path("state-reference")
            shutil.copytree(self.path("state"), state, ignore=shutil.ignore_patterns("LOCK"))
            job = self.write_job("job-reference", world, world, 0, self.path("reference"),
                                 self.path("checkpoints"), self.args.keep_last)
            self.say(f"reference: a run without faults that restores {checkpoint} on {world} "
                     "workers")
            extra = ["--restore", checkpoint]
        else:
            state = self.path("state-reference")
            job = self.write_job("job-reference", world, world, 0, self.path("reference"),
                                 self.path("checkpoints-reference"), self.args.keep_last)
            self.say(f"reference: the final world never restored; a run from scratch on {world} "
                     "workers")
            extra = []
        reference = self.path("reference", "final.safetensors")
        if self.reference_run("reference", job, state, world, extra, reference) is not None:
            with open(final, "rb") as a, open(reference, "rb") as b:
                equal = a.read() == b.read()
            self.results["reference_equal"] = equal
            self.results["reference_diff"] = self.compare(final, reference)
            if not equal:
                self.failures.append(f"final parameters differ from the reference (largest "
                                     f"difference {self.results['reference_diff']})")
        else:
            self.results["reference_equal"] = None
        if self.args.skip_scratch:
            return
        job = self.write_job("job-scratch", self.args.workers, self.args.workers, 0,
                             self.path("scratch"), self.path("checkpoints-scratch"),
                             self.args.keep_last)
        self.say(f"information: an undisturbed run from scratch on {self.args.workers} workers")
        scratch = self.path("scratch", "final.safetensors")
        took = self.reference_run("scratch", job, scratch_state, self.args.workers, [], scratch)
        if took is not None:
            self.results["scratch_diff"] = self.compare(final, scratch)
            self.results["scratch_seconds"] = took

    # -- the report ----------------------------------------------------------------------------

    def time_lost(self):
        """Per fault: seconds to the first step of the next world (rank 0's 'first step of this
        run done'), when a new world started before the next fault."""
        firsts = []
        for worker in self.workers:
            for line in worker.log().splitlines():
                if "first step of this run done" in line:
                    when = log_line_time(line)
                    if when is not None:
                        firsts.append(when)
        firsts.sort()
        fired = [f for f in self.faults if f.fired_at is not None]
        for n, fault in enumerate(fired):
            until = fired[n + 1].fired_at if n + 1 < len(fired) else float("inf")
            at = bisect.bisect_right(firsts, fault.fired_at)
            if at < len(firsts) and firsts[at] <= until:
                fault.lost = firsts[at] - fault.fired_at

    def trained_steps(self, last_seen):
        """The step the job ended at (the coordinator's "training finished (N steps"), else the
        last step the metrics showed."""
        if self.coordinator is not None:
            match = re.search(r"training finished \((\d+) steps", self.coordinator.log())
            if match:
                return int(match.group(1))
        return last_seen

    def events(self):
        """The coordinator's event history: all of it when the job finished, else what was
        read (the soak reads it before each coordinator kill, and before it stops
        everything)."""
        if self.final_events is not None:
            return self.final_events
        return sorted(self.events_seen.values(), key=lambda e: e["sequence"])

    def report(self, outcome):
        self.time_lost()
        fired = [f for f in self.faults if f.fired_at is not None and not f.skipped]
        rows = [("fault", "planned", "injected", "survived", "re-formed", "lost median s",
                 "lost max s")]
        labels = {"kill": "worker SIGKILL", "stop": "worker SIGSTOP", "coordinator":
                  "coordinator SIGKILL", "resize": "shardctl resize", "drain": "shardctl drain",
                  "partition": "network partition", "disk": "checkpoint disk full"}
        _, last_step, last_change, _ = self.monitor.snapshot() if self.monitor else (None,) * 4
        for kind in Fault.KINDS:
            planned = [f for f in self.faults if f.kind == kind]
            if kind in ("partition", "disk") and not planned:
                continue
            done = [f for f in fired if f.kind == kind]
            # Survived: training made progress after it (and, in a pass, the job finished).
            survived = [f for f in done
                        if self.finished or (last_change is not None and last_change > f.fired_at)]
            lost = [f.lost for f in done if f.lost is not None]
            med, mx = median_max(lost)
            rows.append((labels[kind], str(len(planned)), str(len(done)), str(len(survived)),
                         str(len(lost)), med, mx))
        lost_all = [f.lost for f in fired if f.lost is not None]
        med, mx = median_max(lost_all)
        survived_all = [f for f in fired
                        if self.finished or (last_change is not None and last_change > f.fired_at)]
        rows.append(("all faults", str(len(self.faults)), str(len(fired)), str(len(survived_all)),
                     str(len(lost_all)), med, mx))
        width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        print()
        print("==== soak report (seed %d)" % self.args.seed)
        for n, row in enumerate(rows):
            print("  " + "  ".join(cell.ljust(width[i]) if i == 0 else cell.rjust(width[i])
                                   for i, cell in enumerate(row)))
            if n == 0:
                print("  " + "  ".join("-" * w for w in width))
        timing = {t: sum(1 for f in fired if f.timing == t) for t in ("steps", "save", "reform")}
        stops = [f for f in fired if f.kind == "stop"]
        events = self.events()
        kinds = [e.get("kind", "") for e in events]
        facts = [
            ("hangs", f"{self.hangs}" + (" (must be 0)" if self.hangs else "")),
            ("faults injected during", f"steps {timing['steps']}, saves {timing['save']}, "
                                       f"re-formations {timing['reform']}"),
            ("SIGSTOP then", f"SIGCONT {sum(1 for f in stops if f.then == 'cont')}, SIGKILL "
                             f"{sum(1 for f in stops if f.then == 'kill')}"),
            ("replacements", f"at once {self.counts['replaced_now']}, late "
                             f"{self.counts['replaced_late']}; same id {self.counts['same_id']}, "
                             f"new id {self.counts['new_id']}"),
            ("unexpected worker exits", str(len(self.unexpected_exits))),
            ("coordinator events", f"{kinds.count('dead')} deaths, "
                                   f"{kinds.count('reformed') + kinds.count('resized')} "
                                   f"re-formations, {kinds.count('coordinator_recovered')} "
                                   "recoveries after a restart"
                                   + (f" ({len(events)} events)" if self.final_events is not None
                                      else f" (the {len(events)} events read; not all)")),
            ("event history kept", f"across {self.history_checks} of "
                                   f"{self.coordinator_restarts} coordinator restarts"
                                   + (" and to the end" if self.final_events is not None
                                      else "")),
            ("steps", f"{self.trained_steps(last_step)} of {self.args.steps}; job finished: "
                      f"{'yes' if self.finished else 'no'}"),
            ("restores", self.restore_counts()),
        ]
        partitions = [f for f in fired if f.kind == "partition"]
        if partitions:
            variants = {v: sum(1 for f in partitions if f.variant == v)
                        for v in ("pair", "worker", "coordinator")}
            med, mx = median_max([f.longest_quiet for f in partitions])
            facts[1:1] = [
                ("partitions", f"a pair {variants['pair']}, a worker from its peers "
                               f"{variants['worker']}, the coordinator from some "
                               f"{variants['coordinator']}; "
                               f"{sum(f.duration for f in partitions):.0f}s in all"),
                ("longest standstill after a partition", f"median {med}s, max {mx}s (bound "
                                                         f"{self.args.partition_hang_after:.0f}s)"),
                ("reachability events", f"{kinds.count('unreachable')} unreachable, "
                                        f"{kinds.count('isolated')} isolated, "
                                        f"{kinds.count('reachable')} reachable"),
            ]
        if any(f.kind == "disk" for f in fired):
            facts.append(("checkpoint disk", f"{kinds.count('checkpoint_failed')} checkpoint_failed "
                                             f"and {kinds.count('checkpoint_recovered')} "
                                             f"checkpoint_recovered events"))
        if self.finished:
            took = self.end_time - self.start_time
            line = f"{took:.1f}s with faults"
            if "scratch_seconds" in self.results:
                scratch = self.results["scratch_seconds"]
                line += (f", {scratch:.1f}s undisturbed (with its start-up): "
                         f"{(took - scratch) / max(1, len(fired)):.2f}s lost per fault on average")
            facts.append(("wall time", line))
        if "kept" in self.results:
            facts.append(("checkpoints kept / verified",
                          f"{self.results['kept']} / {self.results['verified']}"))
        if "final_world" in self.results:
            restored = self.results.get("restored")
            equal = self.results.get("reference_equal")
            facts.append(("reference", (f"restore {restored} on {self.results['final_world']} "
                                        if restored else
                                        f"from scratch on {self.results['final_world']} ")
                          + "workers: " + ({True: "bitwise equal", False: "DIFFERENT (largest "
                                            f"difference {self.results.get('reference_diff')})",
                                            None: "did not run"}[equal])
                          + (f" ({self.results['reference_missing']})"
                             if "reference_missing" in self.results else "")))
        if "scratch_diff" in self.results:
            facts.append((f"vs undisturbed on {self.args.workers}",
                          f"largest difference {self.results['scratch_diff']} (information)"))
        facts.append(("result", outcome))
        width = max(len(k) for k, _ in facts)
        print()
        for key, value in facts:
            print(f"  {key.ljust(width)}  {value}")
        for fault in self.faults:
            if fault.skipped:
                print(f"  fault {fault.index} ({fault.kind}) not injected: {fault.skipped}")
        for name, code, last in self.unexpected_exits:
            print(f"  unexpected exit: {name} status {code}: {last[:200]}")
        for failure in self.failures:
            print(f"  FAILED: {failure}")
        print(flush=True)

    # -- the whole run -------------------------------------------------------------------------

    def run(self):
        snapshots = (f", a memory snapshot every {self.args.snapshot_every} steps"
                     if self.args.snapshot_every else "")
        self.say(f"soak seed {self.args.seed}: {len(self.faults)} faults over {self.args.steps} "
                 f"steps, {self.args.workers} workers (min {self.args.min_workers}), lease "
                 f"{self.args.lease}s, grace {self.args.grace}s, checkpoint every "
                 f"{self.args.every} steps{snapshots}, hang bound {self.args.hang_after:.0f}s, "
                 f"in {self.dir}")
        for fault in self.faults:
            print(f"    {fault.index:3d}. {fault.describe()}")
        self.set_up()
        self.run_faults()
        self.wait_for_the_end()
        self.verify_checkpoints()
        self.check_parameters()
        if self.unexpected_exits:
            self.failures.append(f"{len(self.unexpected_exits)} worker(s) exited on their own "
                                 "with an error")


def main():
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] + " See docs/elasticity.md (Soak).")
    parser.add_argument("--seed", default=None,
                        help="decides every fault: a number, or A-B for one drawn from that range "
                             "(default: random); printed first, so a failure replays")
    parser.add_argument("--workers", type=int, default=4, help="the job's world size (default 4)")
    parser.add_argument("--min-workers", type=int, default=None,
                        help="the job's minWorldSize (default: workers/2)")
    parser.add_argument("--kills", type=int, default=20, help="worker SIGKILLs (default 20)")
    parser.add_argument("--stops", type=int, default=None,
                        help="worker SIGSTOPs (default: kills/5, at least 1)")
    parser.add_argument("--coordinator-kills", type=int, default=3, help="coordinator SIGKILLs, each restarted (default 3)")
    parser.add_argument("--resizes", type=int, default=2, help="shardctl resize calls (default 2)")
    parser.add_argument("--drains", type=int, default=2, help="shardctl drain calls (default 2)")
    parser.add_argument("--partitions", type=int, default=0,
                        help="network partitions, each healed after up to 20 s (default 0); they "
                             "need root: every process then runs on test hosts made of network "
                             "namespaces (docs/faults.md); without root the soak exits 77")
    parser.add_argument("--disk-faults", type=int, default=0,
                        help="the checkpoint disk (a tmpfs of the soak's own) filled to ENOSPC, "
                             "then freed after 1-10 s (default 0); needs root to mount it, "
                             "without root the soak exits 77")
    parser.add_argument("--partition-hang-after", type=float, default=90.0,
                        help="training must move within this many seconds of each partition's "
                             "start (default 90)")
    parser.add_argument("--steps", type=int, default=None,
                        help="the job's steps (default: enough for the faults)")
    parser.add_argument("--duration", type=float, default=None,
                        help="hard limit on the whole run in seconds (default: from the faults)")
    parser.add_argument("--lease", type=parse_duration, default=parse_duration("1s"),
                        help="coordinator --lease (default 1s)")
    parser.add_argument("--grace", type=parse_duration, default=parse_duration("1s"),
                        help="coordinator --reform-grace (default 1s)")
    parser.add_argument("--every", type=int, default=None,
                        help="checkpoint every N steps (default 5; 1 with --snapshot-every)")
    parser.add_argument("--keep-last", type=int, default=None,
                        help="the job's checkpoint.keepLast (default 50; with --snapshot-every "
                             "every checkpoint, or 500 with --disk-faults)")
    parser.add_argument("--snapshot-every", type=int, default=0,
                        help="memory snapshots every N steps with one replica, recoveries from "
                             "memory where one holds every range (default 0: off)")
    parser.add_argument("--hang-after", type=float, default=None,
                        help="seconds without progress that count as a hang (default: 20 + "
                             "10 x max(lease, grace))")
    parser.add_argument("--build-dir", default=os.path.join(ROOT, os.environ.get(
        "SHARD_BUILD_DIR", "build")), help="where bin/shard-* are (default build/)")
    parser.add_argument("--dir", default=None, help="where to make the temporary directory")
    parser.add_argument("--keep", action="store_true", help="keep the directory after a pass")
    parser.add_argument("--skip-scratch", action="store_true",
                        help="skip the informational run from scratch")
    parser.add_argument("--worker-arg", action="append", default=[],
                        help="extra flag for every shard-worker (repeatable)")
    args = parser.parse_args()
    if args.seed is None:
        args.seed = str(random.SystemRandom().randrange(1, 10**6))
    seeds = re.fullmatch(r"(\d+)(?:-(\d+))?", args.seed)
    if not seeds or (seeds.group(2) and int(seeds.group(2)) < int(seeds.group(1))):
        parser.error("--seed takes a number or a range A-B")
    args.seed = random.SystemRandom().randint(int(seeds.group(1)), int(seeds.group(2))) \
        if seeds.group(2) else int(seeds.group(1))
    if args.workers < 2:
        parser.error("--workers must be at least 2")
    if args.snapshot_every < 0:
        parser.error("--snapshot-every must not be negative")
    if args.every is None:
        args.every = 1 if args.snapshot_every else 5
    if args.every < 1:
        parser.error("--every must be at least 1")
    if args.min_workers is None:
        args.min_workers = max(1, args.workers // 2)
    if not 1 <= args.min_workers <= args.workers:
        parser.error("--min-workers must be in 1..workers")
    if args.stops is None:
        args.stops = max(1, args.kills // 5) if args.kills > 0 else 0
    for name in ("kills", "stops", "coordinator_kills", "resizes", "drains", "partitions"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must not be negative")
    if args.resizes and args.min_workers == args.workers:
        parser.error("--resizes needs --min-workers below --workers")
    schedule = make_schedule(args, random.Random(args.seed))
    faults = len(schedule)
    if args.steps is None:
        # Enough for every fault: each one that waits for training needs the world to gain a
        # checkpoint interval after it settles, then its gap; then a tail without faults.
        # The script's own latency (polling, shardctl calls) lets training run on for a while
        # after it decides to fire; gaps shrink if that takes more (Soak.fitted_gap).
        needed = 2 * args.every + 1 + sum(f.gap + LATENCY_STEPS for f in schedule
                                          if f.timing != "reform")
        # A partition lets training run on (a world without the hosts cut off) for its
        # duration and the fold-in after the heal.
        needed += sum(int(PARTITION_STEPS_PER_SECOND * (f.duration + 10)) for f in schedule
                      if f.kind == "partition")
        args.steps = int(1.2 * needed) + tail_steps(args)
    if args.keep_last is None:
        # With snapshots every checkpoint stays (the reference needs the one of the step the
        # final world restored from memory), but for the last 500 on --disk-faults' 64 MiB disk,
        # which holds about 1,500 of this job's checkpoints.
        args.keep_last = 50 if not args.snapshot_every else (
            500 if args.disk_faults else args.steps + 1)
    if args.keep_last < 1:
        parser.error("--keep-last must be at least 1")
    if args.hang_after is None:
        args.hang_after = 20 + 10 * max(args.lease, args.grace)
    if args.duration is None:
        args.duration = 180 + faults * (15 + 3 * (args.lease + args.grace)) + args.steps * 0.1
        args.duration += sum(f.duration + args.partition_hang_after for f in schedule
                             if f.kind == "partition")
    if args.partitions:
        why = fault_hosts.unavailable()
        if why is not None:
            print(f"soak: skipped: --partitions {why}", flush=True)
            return 77
    if args.disk_faults and os.geteuid() != 0:
        print("soak: skipped: --disk-faults needs root (to mount the checkpoint disk)", flush=True)
        return 77

    print(f"soak: seed {args.seed} (rerun the same schedule with --seed {args.seed})", flush=True)
    soak = None
    outcome = "FAIL"
    code = 1

    def terminate(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, terminate)
    try:
        soak = Soak(args, schedule)
        soak.run()
        if soak.failures:
            outcome = "FAIL"
        else:
            outcome = "PASS"
            code = 0
    except Hang as hang:
        soak.say(f"HANG: {hang}")
        soak.dump(f"HANG: {hang}")
        soak.failures.append(f"hang: {hang}")
        outcome = "FAIL (hang)"
    except SoakFailure as failure:
        if soak is None:
            print(f"soak: {failure}", file=sys.stderr)
            return 1
        soak.say(f"FAILED: {failure}")
        if soak.coordinator is not None and soak.coordinator.alive():
            soak.dump(f"FAILED: {failure}")
        soak.failures.append(str(failure))
    except KeyboardInterrupt as interrupt:
        if soak is not None:
            soak.failures.append(f"interrupted ({interrupt or 'SIGINT'})")
        outcome = "interrupted"
        code = 130
    finally:
        if soak is not None:
            if soak.monitor is not None:
                soak.monitor.stop_event.set()
            if soak.final_events is None and soak.coordinator is not None \
                    and soak.coordinator.alive():
                soak.read_events(tries=1)  # for the report, while the coordinator still answers
            soak.processes.stop()
            if soak.hosts is not None:
                soak.hosts.down()  # the namespaces, and anything still running in them
            if soak.disk_mounted:
                subprocess.run(["umount", "-l", soak.path("checkpoints")], check=False)
    if soak is None:
        print(f"soak: {outcome} (seed {args.seed})", flush=True)
        return code
    try:
        soak.report(outcome)
    except Exception as error:  # the report must not hide the outcome
        print(f"soak: could not print the report: {error!r}", file=sys.stderr)
    if code == 0 and not args.keep:
        shutil.rmtree(soak.dir, ignore_errors=True)
    else:
        print(f"soak: everything is in {soak.dir}", flush=True)
    print(f"soak: {outcome} (seed {args.seed})", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
