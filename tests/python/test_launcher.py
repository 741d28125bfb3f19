"""The launcher, `python3 -m shard.run`, end to end: it starts a real shard-coordinator and
examples/torch/transformer.py ranks, restarts ranks this test kills, passes Ctrl-C on, and
refuses bad command lines.

Run by ctest (python_torch) with SHARD_BUILD_DIR and PYTHONPATH=build/python; by hand:
    SHARD_BUILD_DIR=build PYTHONPATH=build/python /usr/bin/python3 -m pytest tests/python
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from shard.safetensors import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_torch import BIN, BUILD, ONE_THREAD, ROOT, Processes, wait_for  # noqa: E402
from test_torch import TRANSFORMER_ARGS as TINY  # noqa: E402

TRANSFORMER = os.path.join(ROOT, "examples", "torch", "transformer.py")
DEADLINE = 60  # seconds a launch may take: a hang fails the test instead of CI


def alive(pid):
    """Whether `pid` is a process that still runs (not gone, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def kill_launched(logs):
    """SIGKILLs every process the launcher's processes.json (in `logs`) lists as running; none
    before it is written. Only while the launcher runs: the pids it lists as running are then
    its children (at worst zombies), so none of them can belong to another process yet."""
    try:
        with open(os.path.join(logs, "processes.json")) as f:
            processes = json.load(f)
        pids = [rank["pid"] for rank in processes["ranks"] if rank["state"] == "running"]
        if processes["coordinator"] and processes["coordinator"]["running"]:
            pids.append(processes["coordinator"]["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return  # not written, or half written: stopping the launcher stops its children
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class Launch:
    """One `python3 -m shard.run` in `tmp`, its output in a file; at the end every process its
    processes.json lists as running is killed by pid, and the launcher is stopped."""

    def __init__(self, tmp):
        self.tmp = tmp
        self.logs = os.path.join(tmp, "logs")
        # No SHARD_COORDINATOR_BIN: the launcher finds the build tree's shard-coordinator
        # next to the package it runs from.
        env = dict(os.environ, **ONE_THREAD)
        env.pop("SHARD_COORDINATOR_BIN", None)
        self.started = Processes(tmp, BUILD, env=env)
        self.proc = None

    def write_job(self, steps):
        # Three ranks, at least two; a snapshot in memory every 5 steps, so that a re-formed
        # world restores from its peers, and checkpoints on disk as well.
        job = {"name": "launched", "worldSize": 3, "minWorldSize": 2, "model": {"external": {}},
               "optimizer": {"name": "adamw", "lr": 0.003, "weightDecay": 0.1},
               "globalBatch": 24, "steps": steps, "zeroStage": 2,
               "snapshot": {"everySteps": 5},
               "checkpoint": {"everySteps": 50, "keepLast": 2, "dir": "checkpoints"},
               "outputDir": "out"}
        path = os.path.join(self.tmp, "job.json")
        with open(path, "w") as f:
            json.dump(job, f)
        return path

    def start(self, *argv):
        self.proc = self.started.start_python(
            "launcher", ["-m", "shard.run", "--log-dir", self.logs, *argv], log="launcher.out")

    def text(self):
        return self.proc.log()

    def processes(self):
        """The launcher's processes.json, or None before it is written."""
        try:
            with open(os.path.join(self.logs, "processes.json")) as f:
                return json.load(f)
        except FileNotFoundError:
            return None

    def status(self):
        """`shardctl status --json` of the launched coordinator; None if it does not answer.
        Raises once the launcher has exited: whatever was awaited will not come."""
        if self.proc.poll() is not None:
            raise AssertionError(f"the launcher exited with {self.proc.returncode}:\n"
                                 + self.text())
        processes = self.processes()
        if not processes or not processes["coordinator"]["address"]:
            return None
        answer = subprocess.run([os.path.join(BIN, "shardctl"), "--coordinator",
                                 processes["coordinator"]["address"], "status", "--json"],
                                capture_output=True, text=True, timeout=30)
        return json.loads(answer.stdout) if answer.returncode == 0 else None

    def wait(self):
        return self.proc.exit_code(DEADLINE)

    def kill_everything(self):
        if self.proc is not None and self.proc.alive():
            kill_launched(self.logs)
        self.started.stop()


@pytest.fixture
def launch(tmp_path):
    launched = Launch(str(tmp_path))
    yield launched
    launched.kill_everything()


def step_once_held(status, worker_id):
    """The step a settled, running world of three trains at, once `worker_id` holds one of its
    ranks; None before."""
    if (status is None or status["state"] != "running" or status["transition"]
            or status["world_size"] != 3 or status["ranks"] != 3):
        return None
    if not any(w["id"] == worker_id and w["rank"] >= 0 for w in status["workers"]):
        return None
    return status["progress"]["step"] or 0


def test_killed_ranks_are_restarted_under_new_ids_and_the_job_finishes(launch):
    # About 80 steps/s on two cores: both kills land before step 100 and 400 steps leave
    # seconds of training after them.
    job = launch.write_job(steps=400)
    started = time.monotonic()
    launch.start("--standalone", "--job", job, "--coordinator-arg=--lease=1s",
                 "--coordinator-arg=--reform-grace=1s", "--nproc-per-node", "3",
                 "--max-restarts", "2", "--id-prefix", "t", TRANSFORMER, *TINY)

    def trained_past(step):
        status = launch.status()
        return status is not None and (status["progress"]["step"] or 0) >= step

    wait_for(lambda: trained_past(10), DEADLINE, "the world to train 10 steps")
    # Twice: SIGKILL the process of local rank 1 (the second time, the first one's replacement).
    # The launcher starts a replacement with a new id; it joins (as a standby if the dead
    # worker's lease has not run out yet), takes the dead worker's rank, and the job trains on.
    for kill, (victim, replacement) in enumerate((("t-1", "t-1-r1"), ("t-1-r1", "t-1-r2"))):
        rank = launch.processes()["ranks"][1]
        assert rank["worker_id"] == victim and rank["state"] == "running", rank
        os.kill(rank["pid"], signal.SIGKILL)
        held = []

        def replaced():
            held.append(step_once_held(launch.status(), replacement))
            return held[-1] is not None

        wait_for(replaced, DEADLINE, f"{replacement} to take the killed worker's rank")
        wait_for(lambda: trained_past(held[-1] + 10), DEADLINE,
                 f"training after restart {kill + 1}")

    assert launch.wait() == 0, launch.text()
    output = launch.text()
    assert "restart 1 of 2" in output and "restart 2 of 2" in output, output
    assert "[rank 0]" in output and "done: " in output, output
    assert f"coordinator {os.path.join(BIN, 'shard-coordinator')} at" in output, output
    processes = launch.processes()
    assert [r["worker_id"] for r in processes["ranks"]] == ["t-0", "t-1-r2", "t-2"], processes
    assert all(r["state"] == "finished" for r in processes["ranks"]), processes
    assert not processes["coordinator"]["running"], processes
    sys.path.insert(0, os.path.dirname(TRANSFORMER))
    from transformer import Gpt
    Gpt(16, 16, 2, 1, 8).load_state_dict(
        load_file(os.path.join(launch.tmp, "out", "final.safetensors")), strict=True)
    print(f"two ranks killed and replaced, the job finished: {time.monotonic() - started:.1f}s")


def test_ctrl_c_stops_everything_the_launcher_started(launch):
    job = launch.write_job(steps=1000000)
    launch.start("--standalone", "--job", job, "--nproc-per-node", "3", TRANSFORMER, *TINY)

    def training():
        status = launch.status()
        return status is not None and (status["progress"]["step"] or 0) >= 5

    wait_for(training, DEADLINE, "the world to train")
    processes = launch.processes()
    pids = [rank["pid"] for rank in processes["ranks"]] + [processes["coordinator"]["pid"]]
    assert all(alive(pid) for pid in pids), processes
    interrupted = time.monotonic()
    launch.proc.signal(signal.SIGINT)
    wait_for(lambda: launch.proc.poll() is not None and not any(alive(p) for p in pids), 10,
             "the launcher and everything it started to exit after SIGINT")
    took = time.monotonic() - interrupted
    assert launch.proc.returncode == 130, launch.text()
    # The coordinator got the launcher's SIGINT and stopped the job, rather than being killed.
    with open(processes["coordinator"]["log"]) as f:
        log = f.read()
    assert "received Interrupt: stopping the job" in log, log
    print(f"everything gone {took:.1f}s after SIGINT")


ENVIRONMENT = """
import os
import shard  # the launcher's own package
print(" ".join(f"{name}={os.environ.get(name)}" for name in (
    "SHARD_COORDINATOR", "SHARD_ID", "SHARD_HOST", "SHARD_DEVICE", "LOCAL_RANK",
    "LOCAL_WORLD_SIZE")))
"""


def test_each_rank_gets_the_environment_join_reads(launch):
    # The script does not join, so no coordinator needs to run at the address.
    script = os.path.join(launch.tmp, "environment.py")
    with open(script, "w") as f:
        f.write(ENVIRONMENT)
    launch.start("--coordinator", "10.1.2.3:7460", "--host", "10.1.2.4", "--id-prefix", "node7",
                 "--nproc-per-node", "2", "--device", "cpu", script)
    assert launch.wait() == 0, launch.text()
    output = launch.text()
    for i in range(2):
        assert (f"[rank {i}] SHARD_COORDINATOR=10.1.2.3:7460 SHARD_ID=node7-{i} "
                f"SHARD_HOST=10.1.2.4 SHARD_DEVICE=cpu LOCAL_RANK={i} LOCAL_WORLD_SIZE=2"
                in output), output
    assert "done: 2 ranks finished, 0 restarts" in output, output


def test_a_rank_that_keeps_failing_uses_up_the_restarts_and_fails_the_launch(launch):
    script = os.path.join(launch.tmp, "fails.py")
    with open(script, "w") as f:
        f.write("import sys\nsys.exit(3)\n")
    launch.start("--coordinator", "127.0.0.1:9", "--id-prefix", "f", "--max-restarts", "1",
                 script)
    assert launch.wait() == 1, launch.text()
    output = launch.text()
    assert "worker f-0, pid" in output and "exited with status 3; restarting it (restart 1 of 1)" \
        in output, output
    assert "exited with status 3 with no restart left (--max-restarts 1)" in output, output
    (rank,) = launch.processes()["ranks"]
    assert (rank["worker_id"], rank["state"], rank["exit_code"]) == ("f-0-r1", "failed", 3), rank


@pytest.mark.parametrize("argv, message", [
    (["--nproc-per-node", "2", TRANSFORMER], "--standalone --job FILE starts one"),
    (["--standalone", "--coordinator", "127.0.0.1:7460", TRANSFORMER], "say where the coordinator"),
    (["--coordinator", "127.0.0.1:7460", "no-such-script.py"], "no-such-script.py: no such file"),
    (["--standalone", TRANSFORMER], "--standalone needs --job"),
    (["--coordinator", "nowhere", TRANSFORMER], "is not HOST:PORT"),
    (["--coordinator", "127.0.0.1:7460", "--nproc-per-node", "0", TRANSFORMER], "at least 1"),
    ([TRANSFORMER, "--standalone", "--job", "job.json"],
     "the launcher's options go before the script"),
], ids=["no-coordinator", "both", "missing-script", "no-job", "bad-address", "no-ranks",
        "options-after-script"])
def test_usage_errors_exit_2_and_say_what_to_do(tmp_path, argv, message):
    ran = subprocess.run([sys.executable, "-m", "shard.run", *argv], capture_output=True,
                         text=True, timeout=60, cwd=tmp_path)
    assert ran.returncode == 2, ran.stdout + ran.stderr
    assert message in ran.stderr, ran.stderr
    assert not os.listdir(tmp_path), "a refused launch starts nothing and writes nothing"


def test_a_coordinator_that_does_not_serve_in_time_is_a_clear_error_and_is_stopped(launch):
    silent = os.path.join(launch.tmp, "silent-coordinator")
    with open(silent, "w") as f:
        f.write("#!/bin/sh\nexec sleep 60\n")
    os.chmod(silent, 0o755)
    launch.start("--standalone", "--job", launch.write_job(steps=1), "--coordinator-bin", silent,
                 "--coordinator-start-timeout", "1", TRANSFORMER)
    assert launch.wait() == 1, launch.text()
    assert "shard-coordinator did not serve within 1s (--coordinator-start-timeout)" \
        in launch.text(), launch.text()
    processes = launch.processes()
    assert not processes["coordinator"]["running"] and not alive(processes["coordinator"]["pid"])
    assert all(rank["pid"] is None for rank in processes["ranks"]), processes


def test_a_coordinator_binary_that_is_not_there_is_a_usage_error(tmp_path):
    job = Launch(str(tmp_path)).write_job(steps=1)
    ran = subprocess.run([sys.executable, "-m", "shard.run", "--standalone", "--job", job,
                          "--coordinator-bin", str(tmp_path / "missing"), TRANSFORMER],
                         capture_output=True, text=True, timeout=60)
    assert ran.returncode == 2 and "not an executable file" in ran.stderr, ran.stderr
