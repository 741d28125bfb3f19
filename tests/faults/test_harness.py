"""The fault harness itself (scripts/fault-hosts.sh, hosts.py): hosts come up reaching one
another and go leaving nothing behind, partitions drop exactly the links asked for and heal,
loss and delay really apply, and processes started on the hosts die with them.

Run by ctest (faults_network); by hand, as root:
    SHARD_BUILD_DIR=build /usr/bin/python3 -m pytest tests/faults/test_harness.py -v
"""

import os
import shutil
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hosts import FAULT_HOSTS, Hosts, Job, Proc, can_impair  # noqa: E402


def root_namespace():
    """What the hosts must never change here: links, addresses, routes, iptables rules."""
    def run(*argv):
        return subprocess.run(argv, capture_output=True, text=True).stdout
    rules = run("iptables-save")
    rules = "\n".join(line for line in rules.splitlines() if not line.startswith("#"))
    return {"links": run("ip", "-o", "link", "show"), "addresses": run("ip", "-o", "addr"),
            "routes": run("ip", "route"), "iptables": rules}


def namespaces():
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listing.splitlines() if line.strip()}


def test_hosts_reach_one_another_and_leave_nothing_behind():
    before = root_namespace()
    hosts = Hosts(["a", "b", "c"])
    with hosts:
        mine = {n for n in namespaces() if n.startswith(hosts.prefix + ".")}
        assert mine == {f"{hosts.prefix}.{n}" for n in ("sw", "a", "b", "c")}
        addresses = [hosts.addr(n) for n in ("a", "b", "c")]
        assert len(set(addresses)) == 3
        for a in ("a", "b", "c"):
            for b in ("a", "b", "c"):
                if a != b:
                    assert hosts.reaches(a, b), f"{a} does not reach {b}"
        # The hosts see only their own interfaces: no way out to the machine's networks.
        links = hosts.run("a", ["ip", "-o", "link", "show"]).stdout
        assert sorted(line.split(":")[1].strip().split("@")[0] for line in links.splitlines()) \
            == ["eth0", "lo"]
        assert root_namespace() == before, "the root namespace changed while the hosts were up"
    assert not {n for n in namespaces() if n.startswith(hosts.prefix + ".")}
    assert not os.path.exists(f"/run/shard-fault-hosts/{hosts.prefix}")
    assert root_namespace() == before


def test_a_partition_drops_exactly_its_link_both_ways_and_heals():
    with Hosts(["a", "b", "c"]) as hosts:
        hosts.partition("a", "b")
        assert not hosts.reaches("a", "b") and not hosts.reaches("b", "a")
        assert hosts.reaches("a", "c") and hosts.reaches("c", "a")
        assert hosts.reaches("b", "c") and hosts.reaches("c", "b")
        assert "a->b" in hosts.faults() and "b->a" in hosts.faults()
        hosts.heal("a", "b")
        assert hosts.reaches("a", "b") and hosts.reaches("b", "a")
        assert "partitions: none" in hosts.faults()

        hosts.isolate("c", except_=["a"])
        assert hosts.reaches("c", "a") and hosts.reaches("a", "c")
        assert not hosts.reaches("c", "b") and not hosts.reaches("b", "c")
        hosts.isolate("a")
        assert not hosts.reaches("a", "b") and not hosts.reaches("a", "c")
        hosts.heal()
        for a, b in (("a", "b"), ("b", "c"), ("c", "a")):
            assert hosts.reaches(a, b)


def test_a_partition_cuts_an_established_connection():
    """A connection opened before the partition stops carrying data: the rule drops packets,
    not only new connections (what a data path's long-lived sockets see)."""
    with Hosts(["a", "b"]) as hosts:
        server = subprocess.Popen(
            hosts.argv("b", ["/usr/bin/python3", "-c", ECHO_SERVER, hosts.addr("b")]),
            stdout=subprocess.PIPE, text=True)
        try:
            port = server.stdout.readline().strip()
            client = subprocess.Popen(
                hosts.argv("a", ["/usr/bin/python3", "-u", "-c", ECHO_CLIENT, hosts.addr("b"),
                                 port]),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            try:
                client.stdin.write("one\n")
                client.stdin.flush()
                assert client.stdout.readline().strip() == "one"
                hosts.partition("a", "b")
                client.stdin.write("two\n")
                client.stdin.flush()
                assert client.stdout.readline().strip() == "timeout"
                hosts.heal()
                # TCP retransmits what was lost: the echo arrives once the link is back.
                assert client.stdout.readline().strip() == "two"
            finally:
                client.kill()
                client.wait()
        finally:
            server.kill()
            server.wait()


ECHO_SERVER = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept()
while True:
    data = c.recv(100)
    if not data:
        break
    c.sendall(data)
"""

ECHO_CLIENT = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2)
for line in sys.stdin:
    c.sendall(line.encode())
    while True:
        try:
            print(c.recv(100).decode().strip(), flush=True)
            break
        except socket.timeout:
            print("timeout", flush=True)
            c.settimeout(20)
"""


@pytest.mark.skipif(not can_impair(), reason="neither tc netem nor shard-net-impair here "
                    "(scripts/build.sh --target shard-net-impair)")
@pytest.mark.skipif(shutil.which("ping") is None, reason="ping is missing (scripts/setup.sh "
                    "installs iputils-ping)")
def test_loss_and_delay_apply_to_every_link_and_go_away():
    with Hosts(["a", "b", "c"]) as hosts:
        clean, lost = hosts.ping_ms("a", "b", count=10, interval=0.02)
        assert clean < 5 and lost == 0, (clean, lost)

        hosts.impair(delay="20ms")
        for a, b in (("a", "b"), ("b", "c"), ("c", "a")):
            rtt, lost = hosts.ping_ms(a, b, count=10, interval=0.02)
            # 20 ms each way: each host delays what it sends.
            assert 39 <= rtt <= 60 and lost == 0, f"{a}->{b}: {rtt} ms, {lost:.0%} lost"
        hosts.unimpair()

        hosts.impair(delay="20ms", loss="5%")
        pings = 400
        rtt, lost = hosts.ping_ms("a", "b", count=pings, interval=0.01)
        # A ping and its answer each pass one lossy hop: 1 - 0.95^2 = 9.75% lost on average;
        # four standard deviations (1.5% each at 400 pings) either side.
        assert 39 <= rtt <= 60, rtt
        assert 0.035 <= lost <= 0.16, f"{lost:.1%} of {pings} pings lost"
        hosts.unimpair()
        counters = hosts.impairer_logs()  # only where shard-net-impair stands in for netem
        for name, text in counters.items():
            assert " dropped, " in text, f"{name}'s delayer printed no counters:\n{text}"

        clean, lost = hosts.ping_ms("a", "b", count=10, interval=0.02)
        assert clean < 5 and lost == 0, (clean, lost)


def test_processes_and_namespaces_go_whatever_ends_the_test(tmp_path):
    """A `with` block that fails half-way: the processes it started on the hosts are killed
    by pid and the namespaces removed; a set whose owner died is collected by `gc`."""
    hosts = Hosts(["a", "b"])
    started = []
    with pytest.raises(RuntimeError, match="the test failed here"):
        with hosts, Job(hosts, str(tmp_path / "job")) as job:
            for host in ("a", "b"):
                proc = Proc(f"sleeper-{host}", ["sleep", "600"], str(tmp_path / f"{host}.log"),
                            job.env, str(tmp_path), hosts, host)
                job.procs.append(proc)
                started.append(proc)
            assert all(p.alive() for p in started)
            # `ip netns exec` enters the namespace and then execs, so the pid shows up there a
            # moment after the start.
            deadline = time.monotonic() + 10
            while str(started[0].pid) not in subprocess.run(
                    ["ip", "netns", "pids", hosts.ns("a")], capture_output=True,
                    text=True).stdout.split():
                assert time.monotonic() < deadline, "the process is not in host a's namespace"
                time.sleep(0.05)
            raise RuntimeError("the test failed here")
    for proc in started:
        assert proc.poll() is not None, f"{proc.name} (pid {proc.pid}) still runs"
    assert not {n for n in namespaces() if n.startswith(hosts.prefix + ".")}

    # An owner that is gone: its hosts (and whatever runs in them) are collected.
    owner = subprocess.Popen(["true"])
    owner.wait()
    prefix = f"shfgc{os.getpid()}"
    subprocess.run([FAULT_HOSTS, "up", "--prefix", prefix, "--hosts", "2", "--owner",
                    str(owner.pid)], check=True, capture_output=True)
    orphan = subprocess.Popen(["ip", "netns", "exec", f"{prefix}.h1", "sleep", "600"])
    try:
        deadline = time.monotonic() + 10
        while f"{orphan.pid}" not in subprocess.run(
                ["ip", "netns", "pids", f"{prefix}.h1"], capture_output=True,
                text=True).stdout.split():
            assert time.monotonic() < deadline, "the orphan did not enter its namespace"
            time.sleep(0.02)
        collected = subprocess.run([FAULT_HOSTS, "gc"], capture_output=True, text=True)
        assert prefix in collected.stdout, collected.stdout + collected.stderr
        assert orphan.wait(10) is not None
        assert not {n for n in namespaces() if n.startswith(prefix + ".")}
    finally:
        if orphan.poll() is None:
            orphan.kill()
        subprocess.run([FAULT_HOSTS, "down", "--prefix", prefix], capture_output=True)


def test_a_job_trains_across_the_hosts(tmp_path, reference):
    """The baseline the scenarios start from: a coordinator on its own host, three workers on
    three others, their data path over the bridge; the result equals the undisturbed run on
    loopback bit for bit."""
    with Hosts(["coord", "w1", "w2", "w3"]) as hosts, \
            Job(hosts, str(tmp_path), steps=300) as job:
        job.start_coordinator("coord")
        for w in ("w1", "w2", "w3"):
            job.start_worker(w, host=w)
        status = job.wait_for_world(3)
        assert {w["host"] for w in status["workers"]} == {hosts.addr(w) for w in
                                                         ("w1", "w2", "w3")}
        final = job.finish()
        assert job.compare(final, reference.of(job, world=3)) == 0.0
