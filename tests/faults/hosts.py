"""Test hosts made of network namespaces, and a Shard job running on them (docs/faults.md).

`Hosts` builds N hosts with scripts/fault-hosts.sh (a bridge in a "switch" namespace, one
namespace per host with an address on it) and injects the faults between them: partitions
(iptables DROP in the hosts' own namespaces), loss and delay (tc netem, or shard-net-impair
where the kernel has no netem). `Job` starts a coordinator and workers inside given hosts
(`ip netns exec`), each with its log in a temporary directory, and waits for what the tests
ask (a step, a world size, an event) with deadlines, polling `shardctl status --json` and
`shardctl events --json`: never a sleep as synchronization. On exit (a pass, a failure, Ctrl-C
or SIGTERM) every process is killed by pid and every namespace removed; processes also die with
the test runner (PR_SET_PDEATHSIG through setpriv), and a set of hosts whose runner was killed
is collected by the next run (`fault-hosts.sh gc`).

Standard library only (Debian's /usr/bin/python3). Used by tests/faults/test_*.py and
scripts/soak.py (--partitions).

    with Hosts(["coord", "w1", "w2", "w3"]) as hosts, Job(hosts, tmp) as job:
        job.start_coordinator("coord")
        for w in ("w1", "w2", "w3"):
            job.start_worker(w, host=w)
        job.wait_for_step(50)
        hosts.partition("w1", "w2")
        ...
"""

import ctypes
import datetime
import json
import math
import os
import re
import shutil
import signal
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.abspath(os.environ.get("SHARD_BUILD_DIR", os.path.join(ROOT, "build")))
BIN = os.path.join(BUILD, "bin")
FAULT_HOSTS = os.path.join(ROOT, "scripts", "fault-hosts.sh")
BINARIES = ("shard-coordinator", "shard-worker", "shardctl")


def unavailable():
    """Why network-namespace hosts cannot be built here (a string), or None if they can."""
    if os.geteuid() != 0:
        return "needs root: test hosts are network namespaces and iptables rules (CI runs as root)"
    if shutil.which("ip") is None:
        return "needs ip (iproute2) for network namespaces"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns` is unavailable here: {probe.stderr.strip()}"
    if shutil.which(os.environ.get("SHARD_IPTABLES", "iptables")) is None:
        return "needs iptables (scripts/setup.sh installs it)"
    return None


def missing_binaries():
    """The binaries of the build the tests need and lack (a message), or None."""
    missing = [name for name in BINARIES if not os.access(os.path.join(BIN, name), os.X_OK)]
    if missing:
        return (f"{', '.join(missing)} missing in {BIN}: build first (scripts/build.sh --target "
                "shard-coordinator shard-worker shardctl shard-net-impair)")
    return None


def can_impair():
    """Whether `Hosts.impair` can work: the kernel has netem, or shard-net-impair is built."""
    check = subprocess.run([FAULT_HOSTS, "check"], capture_output=True, text=True,
                           env=dict(os.environ, SHARD_BUILD_DIR=BUILD))
    return "netem: yes" in check.stdout or "shard-net-impair: /" in check.stdout


def wait_for(predicate, seconds, what, poll=0.1, on_timeout=None):
    """Polls `predicate` until it returns something true (returned), for at most `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            detail = on_timeout() if on_timeout is not None else ""
            raise AssertionError(f"timed out after {seconds:.0f}s waiting for {what}"
                                 + (f"\n{detail}" if detail else ""))
        time.sleep(poll)


def raise_on_sigterm():
    """SIGTERM (ctest's timeout, a CI cancel) unwinds like Ctrl-C, so that every `with` block
    cleans up. Call once, from the main thread."""
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, handler)


# ----------------------------------------------------------------------------------------------
# Hosts


class Hosts:
    """N test hosts (network namespaces on one bridge) built by scripts/fault-hosts.sh, and the
    faults between them. A context manager: the hosts go, with every process in them, on exit."""

    _count = 0

    def __init__(self, names, prefix=None, rate=None, log=None):
        """`rate` (e.g. "8mbit"): every host's link speed (what it sends), None: unlimited."""
        Hosts._count += 1
        self.names = list(names)
        self.rate = rate
        # Unique per process and per set: parallel runs never share a name.
        self.prefix = prefix or f"shf{os.getpid()}-{Hosts._count}"
        self.log = log or (lambda message: print(message, flush=True))
        self.hosts = {}  # name -> (namespace, address)
        self.is_up = False

    def _script(self, *argv, check=True, timeout=60):
        result = subprocess.run([FAULT_HOSTS, *argv], capture_output=True, text=True,
                                timeout=timeout, stdin=subprocess.DEVNULL,
                                env=dict(os.environ, SHARD_BUILD_DIR=BUILD))
        if check and result.returncode != 0:
            raise RuntimeError(f"fault-hosts.sh {' '.join(argv)} failed ({result.returncode}): "
                               f"{result.stderr.strip()} {result.stdout.strip()}")
        return result.stdout

    def up(self):
        self._script("gc", check=False)  # sets left by runners that were SIGKILLed
        self._script("up", "--prefix", self.prefix, "--hosts", ",".join(self.names),
                     "--owner", str(os.getpid()), *(["--rate", self.rate] if self.rate else []))
        self.is_up = True
        for line in self._script("hosts", self.prefix).splitlines():
            name, namespace, address = line.split()
            self.hosts[name] = (namespace, address)
        self.log(f"hosts {self.prefix}: " + ", ".join(f"{n} {a}" for n, (_, a) in
                                                      self.hosts.items())
                 + (f"; links of {self.rate}" if self.rate else ""))
        return self

    def down(self):
        if self.is_up:
            self.is_up = False
            self._script("down", "--prefix", self.prefix, check=False)
            self.log(f"hosts {self.prefix}: down")

    def __enter__(self):
        try:
            return self.up()
        except BaseException:
            self.down()
            raise

    def __exit__(self, *exc):
        self.down()

    def addr(self, host):
        return self.hosts[host][1]

    def ns(self, host):
        return self.hosts[host][0]

    def argv(self, host, argv):
        """`argv` run on `host`."""
        return ["ip", "netns", "exec", self.ns(host), *argv]

    def run(self, host, argv, timeout=30, **kwargs):
        return subprocess.run(self.argv(host, argv), capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL, **kwargs)

    # -- faults --------------------------------------------------------------------------------

    def partition(self, a, b):
        """Everything between `a` and `b` dropped, both ways."""
        self._script("partition", self.prefix, a, b)
        self.log(f"FAULT {a} <-/-> {b}")

    def isolate(self, host, except_=()):
        """`host` partitioned from every other host but those in `except_`."""
        argv = ["isolate", self.prefix, host]
        if except_:
            argv += ["--except", ",".join(except_)]
        self._script(*argv)
        self.log(f"FAULT {host} cut off from every host"
                 + (f" but {', '.join(except_)}" if except_ else ""))

    def heal(self, a=None, b=None):
        """Every partition (no arguments), those of `a`, or the one between `a` and `b`."""
        self._script("heal", self.prefix, *[h for h in (a, b) if h is not None])
        self.log("HEAL " + (f"{a} <-> {b}" if b else a if a else "every partition"))

    def impair(self, delay="20ms", loss="0%", hosts=None, seed=1, via="auto"):
        """Every packet the hosts (all by default) send is delayed and lost with that chance."""
        argv = ["impair", self.prefix, "--delay", delay, "--loss", loss, "--seed", str(seed),
                "--via", via]
        if hosts:
            argv += ["--hosts", ",".join(hosts)]
        self.log("FAULT " + self._script(*argv).strip())

    def unimpair(self):
        self._script("unimpair", self.prefix)
        self.log("HEAL every link clean")

    def faults(self):
        return self._script("faults", self.prefix)

    def impairer_logs(self):
        """What each host's shard-net-impair said (its counters, once it stopped)."""
        found = {}
        state = os.environ.get("SHARD_FAULT_HOSTS_STATE", "/run/shard-fault-hosts")
        for name in self.names:
            path = os.path.join(state, self.prefix, f"impair-{name}.log")
            if os.path.exists(path):
                with open(path) as handle:
                    found[name] = handle.read()
        return found

    # -- probes --------------------------------------------------------------------------------

    def reaches(self, a, b, timeout=1.0):
        """Whether `a` can open a TCP connection to `b` (to a listener started on `b` for the
        probe): the data path's own kind of traffic, not ICMP."""
        server = subprocess.Popen(
            self.argv(b, ["/usr/bin/python3", "-c", _PROBE_SERVER, self.addr(b)]),
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            port = server.stdout.readline().strip()
            if not port:
                raise RuntimeError(f"the probe listener on {b} did not start")
            probe = self.run(a, ["/usr/bin/python3", "-c", _PROBE_CLIENT, self.addr(b), port,
                                 str(timeout)], timeout=timeout + 10)
            return probe.returncode == 0
        finally:
            server.kill()
            server.wait()

    def ping_ms(self, a, b, count=20, interval=0.05):
        """(median round trip in ms, fraction lost) of `count` pings from `a` to `b`; None if
        ping is missing."""
        if shutil.which("ping") is None:
            return None
        result = self.run(a, ["ping", "-n", "-c", str(count), "-i", str(interval), "-W", "2",
                              self.addr(b)], timeout=count * interval + 30)
        times = [float(t) for t in re.findall(r"time=([0-9.]+) ms", result.stdout)]
        lost = 1 - len(times) / count
        times.sort()
        return (times[len(times) // 2] if times else math.inf), lost


_PROBE_SERVER = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(16)
print(s.getsockname()[1], flush=True)
while True:
    c, _ = s.accept(); c.close()
"""

_PROBE_CLIENT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
except OSError:
    sys.exit(1)
"""


# ----------------------------------------------------------------------------------------------
# Entering a host from a thread of this process (for an HTTP poller, a socket)

_CLONE_NEWNET = 0x40000000


def enter_netns(namespace):
    """Moves the calling thread (only it: setns acts per thread) into network namespace
    `namespace`; sockets it opens from then on live there. For a polling thread, never for the
    main thread, which starts processes."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {namespace}: {os.strerror(err)}")
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------------------------
# Processes


def _log_time(line):
    """When a log line of our binaries ("2026-11-22T16:27:14.750 I ...") was written."""
    try:
        return datetime.datetime.strptime(line[:23], "%Y-%m-%dT%H:%M:%S.%f").timestamp()
    except ValueError:
        return None


class Proc:
    """A process started on a host (or here, host None), its output in `log_path`."""

    def __init__(self, name, argv, log_path, env, cwd, hosts=None, host=None):
        self.name, self.host, self.log_path = name, host, log_path
        self.argv = argv
        command = hosts.argv(host, argv) if host is not None else list(argv)
        if shutil.which("setpriv"):
            # Dies with the test runner, even one killed by SIGKILL. `ip netns exec` execs the
            # program in place, so the pid is the program's and the setting carries over.
            command = ["setpriv", "--pdeathsig", "KILL", "--"] + command
        self._log_file = open(log_path, "w")
        self.popen = subprocess.Popen(command, stdout=self._log_file, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                                      start_new_session=True)
        self.pid = self.popen.pid
        self.killed = False

    def poll(self):
        code = self.popen.poll()
        if code is not None and not self._log_file.closed:
            self._log_file.close()
        return code

    def alive(self):
        return self.poll() is None

    def signal(self, sig):
        if self.alive():
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self):
        self.killed = True
        self.signal(signal.SIGKILL)
        self.wait(10)

    def wait(self, timeout):
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        return self.poll()

    def log(self):
        try:
            with open(self.log_path, errors="replace") as handle:
                return handle.read()
        except OSError:
            return ""

    def tail(self, lines=20):
        return "\n".join(self.log().splitlines()[-lines:])


# ----------------------------------------------------------------------------------------------
# A job


class Job:
    """A training job of the built-in MLP on test hosts: its data, spec, coordinator and workers,
    and the waits and checks the tests make. Every process is killed by pid on exit."""

    def __init__(self, hosts, tmp, name="faults", steps=1500, world=3, min_world=2, every=20,
                 snapshot_every=0, lease="2s", grace="2s", widths=(32, 64, 10),
                 optimizer=None, bucket_cap_mb=0.004, worker_args=(), coordinator_args=(),
                 log=None):
        self.hosts = hosts
        self.tmp = os.path.abspath(tmp)
        os.makedirs(self.tmp, exist_ok=True)
        self.name = name
        self.steps, self.world, self.min_world, self.every = steps, world, min_world, every
        self.snapshot_every = snapshot_every
        self.lease, self.grace = lease, grace
        self.widths = list(widths)
        # Adam at a learning rate where runs on 1, 2 and 3 workers agree within 2e-7 after
        # 1500 steps while one step more or less moves the parameters by 4e-4: the 1e-4 bound
        # against an undisturbed run then tells a lost or repeated step from reduction order.
        self.optimizer = optimizer or {"name": "adam", "lr": 0.0005}
        self.bucket_cap_mb = bucket_cap_mb
        self.worker_args = list(worker_args)
        self.coordinator_args = list(coordinator_args)
        self.log = log or (lambda message: print(message, flush=True))
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SHARD_")}
        self.env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
        self.procs = []
        self.workers = {}  # id -> the latest Proc of that id
        self.coordinator = None
        self.coordinator_host = None
        self.address = None  # host:port of the coordinator
        self.started = time.time()
        self.data = os.path.join(self.tmp, "data.safetensors")
        self.job_file = None

    # -- set-up --------------------------------------------------------------------------------

    def __enter__(self):
        missing = missing_binaries()
        if missing:
            raise RuntimeError(missing)
        self.generate_data()
        self.job_file = self.write_job("job", self.world, self.min_world, self.every, "out",
                                       "checkpoints")
        return self

    def __exit__(self, *exc):
        self.kill_everything()

    def generate_data(self):
        if os.path.exists(self.data):
            return
        tool = self.tool("data", "generate", "--widths", ",".join(map(str, self.widths)),
                         "--samples", "4096", "--seed", "9", "--out", self.data)
        if tool.returncode != 0:
            raise RuntimeError(f"shardctl data generate failed: {tool.stderr}")

    def spec(self, world, min_world, every, out, checkpoints):
        # The global batch divides over every world size up to the job's (96 for 3 and 4), and
        # is the same in the references, whatever their world size.
        batch = math.lcm(*range(1, max(world, self.world) + 1))
        batch *= max(1, math.ceil(96 / batch))
        return {
            "name": self.name, "worldSize": world, "minWorldSize": min_world,
            "model": {"mlp": {"widths": self.widths}}, "data": {"path": self.data},
            "seed": 11, "optimizer": self.optimizer, "globalBatch": batch,
            "steps": self.steps, "zeroStage": 2, "bucketCapMb": self.bucket_cap_mb,
            "checkpoint": {"dir": os.path.join(self.tmp, checkpoints), "everySteps": every,
                           "keepLast": 1000},
            "snapshot": {"everySteps": self.snapshot_every},
            "outputDir": os.path.join(self.tmp, out),
        }

    def write_job(self, label, world, min_world, every, out, checkpoints):
        path = os.path.join(self.tmp, f"{label}.json")
        with open(path, "w") as handle:
            json.dump(self.spec(world, min_world, every, out, checkpoints), handle, indent=2)
        return path

    def tool(self, *argv, timeout=60):
        """shardctl without a coordinator (data, compare, checkpoint --path), run here."""
        return subprocess.run([os.path.join(BIN, "shardctl"), *argv], capture_output=True,
                              text=True, timeout=timeout, env=self.env, stdin=subprocess.DEVNULL)

    def path(self, *parts):
        return os.path.join(self.tmp, *parts)

    def say(self, message):
        self.log(f"[{time.time() - self.started:6.1f}s] {message}")

    # -- processes -----------------------------------------------------------------------------

    def _start(self, name, argv, log_name, host):
        proc = Proc(name, argv, self.path(log_name), self.env, self.tmp, self.hosts, host)
        self.procs.append(proc)
        return proc

    def start_coordinator(self, host, extra=(), state="state", job_file=None,
                          log_name="coordinator.log"):
        """The job's coordinator on `host`, listening on the host's address; returns once its
        port file is written."""
        port_file = self.path(f"{log_name}.port")
        if os.path.exists(port_file):
            os.remove(port_file)
        address = self.hosts.addr(host) if host is not None else "127.0.0.1"
        argv = [os.path.join(BIN, "shard-coordinator"), "--job", job_file or self.job_file,
                "--listen", f"{address}:0", "--port-file", port_file,
                "--state-dir", self.path(state), "--lease", self.lease,
                "--reform-grace", self.grace, *self.coordinator_args, *extra]
        coordinator = self._start("coordinator", argv, log_name, host)

        def port():
            if coordinator.poll() is not None:
                raise AssertionError(f"the coordinator exited ({coordinator.returncode}):\n"
                                     + coordinator.tail())
            try:
                with open(port_file) as handle:
                    return int(handle.read().strip() or 0)
            except (OSError, ValueError):
                return 0

        bound = wait_for(port, 30, "the coordinator's port file", poll=0.05)
        self.coordinator, self.coordinator_host = coordinator, host
        self.address = f"{address}:{bound}"
        self.say(f"coordinator on {host or 'this host'} at {self.address}")
        return coordinator

    def start_worker(self, worker_id, host, extra=(), address=None):
        """Worker `worker_id` on `host`: peers reach its data path at the host's address."""
        incarnation = sum(1 for p in self.procs if p.name.startswith(f"{worker_id}#")) + 1
        worker_host = self.hosts.addr(host) if host is not None else "127.0.0.1"
        argv = [os.path.join(BIN, "shard-worker"), "--coordinator", address or self.address,
                "--id", worker_id, "--host", worker_host, "--compute-threads", "1",
                *self.worker_args, *extra]
        worker = self._start(f"{worker_id}#{incarnation}", argv,
                             f"{worker_id}-{incarnation}.log", host)
        worker.id = worker_id
        self.workers[worker_id] = worker
        return worker

    def kill_everything(self):
        for proc in self.procs:
            if proc.alive():
                proc.signal(signal.SIGKILL)
        for proc in self.procs:
            proc.wait(10)

    # -- the coordinator, through shardctl -----------------------------------------------------

    def shardctl(self, *argv, timeout=20):
        """shardctl against the coordinator, run on the coordinator's host (where its address
        is reachable); never raises on a timeout."""
        command = [os.path.join(BIN, "shardctl"), "--coordinator", self.address, "--timeout",
                   "5s", *argv]
        if self.coordinator_host is not None:
            command = self.hosts.argv(self.coordinator_host, command)
        try:
            return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                                  env=self.env, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(command, 124, "", f"no answer within {timeout}s")

    def status(self):
        """`shardctl status --json`, or None without an answer."""
        result = self.shardctl("status", "--json")
        if result.returncode != 0:
            return None
        try:
            return json.loads(result.stdout)
        except ValueError:
            return None

    def events(self):
        """`shardctl events --json`, oldest first; None without an answer."""
        result = self.shardctl("events", "--json")
        if result.returncode != 0:
            return None
        try:
            return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
        except ValueError:
            return None

    def step(self):
        status = self.status() or {}
        return ((status.get("progress") or {}).get("step")) or 0

    # -- waits ---------------------------------------------------------------------------------

    def diagnose(self):
        """What a failed wait prints: status, the last events, the logs' tails."""
        parts = []
        if self.coordinator is not None and self.coordinator.alive():
            status = self.shardctl("status")
            parts.append("---- shardctl status\n" + (status.stdout or status.stderr))
            events = self.shardctl("events")
            parts.append("---- shardctl events (last 30)\n"
                         + "\n".join((events.stdout or events.stderr).splitlines()[-30:]))
        for proc in self.procs:
            state = "running" if proc.alive() else f"exited {proc.poll()}"
            parts.append(f"---- {os.path.basename(proc.log_path)} ({proc.name} on "
                         f"{proc.host or 'this host'}, {state}; last 15 lines)\n"
                         + proc.tail(15))
        parts.append(f"---- hosts\n{self.hosts.faults() if self.hosts else ''}")
        return "\n".join(parts)

    def wait_for(self, predicate, seconds, what, poll=0.2):
        def checked():
            if self.coordinator is not None and self.coordinator.poll() not in (None, 0):
                raise AssertionError(f"the coordinator exited with {self.coordinator.returncode}"
                                     f" while waiting for {what}:\n{self.diagnose()}")
            return predicate()
        return wait_for(checked, seconds, what, poll=poll, on_timeout=self.diagnose)

    def wait_for_step(self, step, seconds=60):
        """Until the coordinator reports training at `step` or beyond; returns the step."""
        return self.wait_for(lambda: (lambda s: s if s >= step else 0)(self.step()), seconds,
                             f"training to reach step {step}")

    def wait_for_world(self, ranks, seconds=60, running=True):
        """Until the world runs with exactly `ranks` ranks held and nothing in transition;
        returns the status."""
        def settled():
            status = self.status()
            if (status is not None and status.get("ranks") == ranks
                    and status.get("world_size") == ranks
                    and (not running or status.get("state") == "running")):
                return status
            return None
        return self.wait_for(settled, seconds, f"a running world of {ranks} ranks")

    def wait_for_progress(self, seconds=60, steps=1, since=None):
        """Until training moved `steps` past `since` (default: the step now); returns
        (the step reached, seconds waited)."""
        began = time.monotonic()
        base = self.step() if since is None else since
        reached = self.wait_for(lambda: (lambda s: s if s >= base + steps else 0)(self.step()),
                                seconds, f"training to move {steps} steps past step {base}")
        return reached, time.monotonic() - began

    def wait_for_training_after(self, generation, world_size=None, steps=5, seconds=60):
        """Until a generation after `generation` (with `world_size` ranks, if given) has trained
        `steps` steps past the first step it was seen at; returns (its status, seconds waited).
        The step a new generation starts from is its restore point, so this is progress, not
        the step counter catching up."""
        began = time.monotonic()
        base = {}

        def trained():
            status = self.status()
            if status is None or status.get("state") != "running":
                return None
            current = status.get("generation", 0)
            if current <= generation:
                return None
            if world_size is not None and status.get("world_size") != world_size:
                return None
            step = (status.get("progress") or {}).get("step") or 0
            base.setdefault(current, step)
            return status if step >= base[current] + steps else None

        what = (f"a generation after {generation}"
                + (f" with {world_size} ranks" if world_size else "") + f" to train {steps} steps")
        status = self.wait_for(trained, seconds, what)
        return status, time.monotonic() - began

    def wait_for_event(self, kind, seconds=60, after=0, match=None):
        """Until an event of `kind` (sequence > `after`; its worker id and detail matching the
        regular expression `match`) is listed; returns it."""
        def found():
            for event in self.events() or []:
                text = f"{event.get('worker_id', '')} {event.get('detail', '')}"
                if (event.get("kind") == kind and event.get("sequence", 0) > after
                        and (match is None or re.search(match, text))):
                    return event
            return None
        return self.wait_for(found, seconds, f"an event '{kind}'"
                             + (f" matching {match!r}" if match else ""))

    def last_sequence(self):
        events = self.events() or []
        return max((e.get("sequence", 0) for e in events), default=0)

    def finish(self, seconds=120):
        """Until the job finishes: the coordinator exits 0 after "training finished" and every
        worker still running exits 0. Returns the job's final parameters' path."""
        code = self.wait_for(lambda: self.coordinator.poll() is not None or None, seconds,
                             "the job to finish")
        code = self.coordinator.poll()
        assert code == 0 and "training finished (" in self.coordinator.log(), (
            f"the coordinator exited {code} without finishing the job:\n{self.diagnose()}")
        for worker in self.workers.values():
            if worker.killed:
                continue
            exit_code = worker.wait(30)
            assert exit_code == 0, (f"{worker.name} exited with {exit_code} after the job "
                                    f"finished:\n{worker.tail(20)}")
        self.say("the job finished")
        return self.path("out", "final.safetensors")

    # -- checks --------------------------------------------------------------------------------

    def compare(self, a, b):
        """The largest absolute difference between two safetensors files (shardctl compare)."""
        result = self.tool("compare", a, b, "--json")
        try:
            return float(json.loads(result.stdout)["max_abs_diff"])
        except (ValueError, KeyError):
            raise AssertionError(f"shardctl compare {a} {b} failed: {result.stderr}"
                                 f"{result.stdout}")

    def worker_logs(self):
        return [p for p in self.procs if hasattr(p, "id")]

    def training_evidence(self):
        """(time, generation, worker, what) of every line in the workers' logs that shows a
        generation training: a step done ("step N/M", "first step of this run done") or a
        checkpoint shard written, with the generation of the log context ("gen=G")."""
        evidence = []
        for proc in self.worker_logs():
            for line in proc.log().splitlines():
                if not ("first step of this run done" in line or
                        re.search(r"\bstep \d+/\d+ loss", line) or
                        re.search(r"checkpoint \S+ \(step \d+\): shard written", line)):
                    continue
                generation = re.search(r"\bgen=(\d+)", line)
                when = _log_time(line)
                if generation and when is not None:
                    evidence.append((when, int(generation.group(1)), proc.name, line))
        evidence.sort()
        return evidence

    def assert_no_split_brain(self):
        """No two generations trained at once: in the workers' logs, once a generation has done
        a step or written a checkpoint shard, no older generation does either (by the log
        lines' times, on one machine's clock)."""
        evidence = self.training_evidence()
        assert evidence, "no training step in any worker's log (is the log format the same?)"
        newest = (0, 0.0, "", "")
        for when, generation, name, line in evidence:
            if generation < newest[0]:
                raise AssertionError(
                    f"split brain: generation {generation} trained ({name}: {line.strip()}) "
                    f"after generation {newest[0]} had ({newest[2]}: {newest[3].strip()})")
            if generation > newest[0]:
                newest = (generation, when, name, line)
        return len(evidence), sorted({g for _, g, _, _ in evidence})

    def restores(self):
        """The checkpoint each worker that finished restored last (its "restoring from checkpoint
        ID" line), by worker process name; None for one that never restored."""
        found = {}
        for proc in self.worker_logs():
            text = proc.log()
            if "training finished:" not in text:
                continue
            last = None
            for line in text.splitlines():
                at = line.find("restoring from checkpoint ")
                if at >= 0:
                    last = line[at + len("restoring from checkpoint "):].split(" ")[0]
                elif "restoring from memory snapshot " in line:
                    snapshot = line.split("restoring from memory snapshot ")[1].split(" ")[0]
                    last = "memory:" + snapshot
            found[proc.name] = last
        return found

    def final_segment_reference(self, seconds=120):
        """The soak's bound (scripts/soak.py, chaos_test.cc): a run without faults, on this
        machine's loopback, that restores the checkpoint the final world restored, on as many
        workers, with no checkpoints of its own; its final parameters' path. With no restore,
        a run from scratch on that many workers."""
        restores = self.restores()
        assert restores, "no worker logged 'training finished:'"
        assert len(set(restores.values())) == 1, (
            f"the final world's workers restored different things last: {restores}")
        restored = next(iter(restores.values()))
        assert restored is None or not restored.startswith("memory:"), (
            f"the final world restored a memory snapshot ({restored}): no checkpoint to replay")
        world = len(restores)
        state = self.path("state-reference")
        shutil.rmtree(state, ignore_errors=True)
        extra = []
        if restored is not None:
            shutil.copytree(self.path("state"), state, ignore=shutil.ignore_patterns("LOCK"))
            extra = ["--restore", restored]
        job = self.write_job("reference", world, world, 0, "reference", "checkpoints")
        if restored is None:
            job = self.write_job("reference", world, world, 0, "reference",
                                 "checkpoints-reference")
        self.say(f"reference: {'restore ' + restored if restored else 'from scratch'} on "
                 f"{world} workers, no faults")
        out = self.path("reference", "final.safetensors")
        run_undisturbed(self, job, state, world, extra, "reference", seconds)
        return out, restored, world


def run_undisturbed(job, job_file, state, world, extra, label, seconds=180):
    """A run of `job_file` without faults on this machine's loopback: a coordinator on `state`
    (with `extra` flags) and `world` workers; asserts it finished."""
    port_file = job.path(f"{label}.port")
    if os.path.exists(port_file):
        os.remove(port_file)
    coordinator = job._start(f"{label}-coordinator",
                             [os.path.join(BIN, "shard-coordinator"), "--job", job_file,
                              "--listen", "127.0.0.1:0", "--port-file", port_file,
                              "--state-dir", state, "--lease", "5s", "--reform-grace", "5s",
                              *extra], f"{label}-coordinator.log", None)

    def port():
        if coordinator.poll() is not None:
            raise AssertionError(f"{label}: the coordinator exited:\n{coordinator.tail()}")
        try:
            with open(port_file) as handle:
                return int(handle.read().strip() or 0)
        except (OSError, ValueError):
            return 0
    bound = wait_for(port, 30, f"{label}: the coordinator's port file", poll=0.05)
    workers = [job._start(f"{label}{i}", [os.path.join(BIN, "shard-worker"), "--coordinator",
                                          f"127.0.0.1:{bound}", "--id", f"{label}{i}",
                                          "--compute-threads", "1"],
                          f"{label}{i}.log", None) for i in range(world)]
    code = coordinator.wait(seconds)
    if code is None:
        raise AssertionError(f"{label}: not finished within {seconds}s:\n{coordinator.tail()}")
    for worker in workers:
        if worker.wait(20) is None:
            worker.kill()
    assert code == 0, f"{label}: the coordinator exited {code}:\n{coordinator.tail()}"


class Reference:
    """The final parameters of a job run without faults from scratch in one process (one
    worker, on loopback: no collectives), computed once per spec and shared (a pytest session
    fixture holds one). The job's global batch is the same on any world size, so runs on 1, 2
    or 3 workers differ only by the order of the reductions' additions (2e-7 for the tests'
    jobs), far below what a lost or repeated step changes (4e-4)."""

    def __init__(self, tmp):
        self.tmp = tmp
        self.cache = {}

    def of(self, job, world=1):
        spec = job.spec(job.world, job.world, 0, "out", "checkpoints")
        key = json.dumps({k: v for k, v in spec.items()
                          if k not in ("checkpoint", "outputDir", "data")}, sort_keys=True)
        key += f"/{world}"
        if key not in self.cache:
            tmp = os.path.join(self.tmp, f"undisturbed-{len(self.cache)}")
            os.makedirs(tmp, exist_ok=True)
            reference = Job(None, tmp, name=job.name, steps=job.steps, world=job.world,
                            min_world=job.world, every=0, snapshot_every=job.snapshot_every,
                            widths=job.widths, optimizer=job.optimizer,
                            bucket_cap_mb=job.bucket_cap_mb, log=job.log)
            with reference:
                began = time.time()
                job_file = reference.write_job("undisturbed", world, world, 0, "out",
                                               "checkpoints")
                run_undisturbed(reference, job_file, reference.path("state"), world, [],
                                "undisturbed", 300)
                job.say(f"undisturbed reference on {world} worker(s): "
                        f"{time.time() - began:.1f}s")
            self.cache[key] = reference.path("out", "final.safetensors")
        return self.cache[key]
