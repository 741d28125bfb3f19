"""Network partitions on test hosts (issue 30, "What it must show"): a coordinator on host
`coord` and three CPU workers on hosts w1, w2, w3 (network namespaces on one bridge,
scripts/fault-hosts.sh) train the built-in MLP (`minWorldSize` 2, a checkpoint every 20
steps, no memory snapshots: every recovery restores a checkpoint, which the reference replays)
while iptables in the hosts' namespaces drops every packet of one link or several:

  (a) w1 <-/-> w2, both still reaching the coordinator;
  (b) one worker cut off from every peer, still reaching the coordinator;
  (c) one worker cut off from the coordinator only, for 20 s;
  (d) the coordinator cut off from two of the three workers, for 20 s.

Each time training must move again within 60 s of the fault, the job must finish, and
  - the final parameters equal, within 1e-4, the same job run undisturbed in one process (one
    worker: no collectives; runs on 1, 2 and 3 workers agree within 2e-7 at this learning rate,
    while one step more or less moves them by 4e-4: the bound sees a lost or repeated step, not
    the order of the reductions),
  - and bit for bit a run without faults that restores the checkpoint the final world restored,
    on as many workers (the soak's and chaos_test.cc's bound, scripts/soak.py);
  - no two generations trained at once (the workers' logs: once a generation stepped or saved,
    no older one did).
(a) and (b) also need the event log to name the broken link (`unreachable`) and the worker left
out (`isolated`), and the worker left out to be folded back in once the link heals
(`reachable`, then 3 ranks again).

Run by ctest (faults_network, as root); by hand:
    SHARD_BUILD_DIR=build /usr/bin/python3 -m pytest tests/faults/test_partitions.py -v
"""

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hosts import Hosts, Job  # noqa: E402

HOSTS = ["coord", "w1", "w2", "w3"]
WORKERS = ["w1", "w2", "w3"]
# Every host's link runs at 8 Mbit/s: about 50 steps/s on 3 workers however fast the machine
# (about 200 without the limit on the project's 2-core VM), so that the job still trains when
# a 20 s partition heals and the worker left out is folded back in, while the references, on
# this machine's loopback, run at full speed.
LINK_RATE = "8mbit"
# Steps: enough that training outlasts the fault, the re-formation and the fold-in with room to
# spare (about 300 steps go by in (a), (b) and (d) before the world is whole again, 1300 in
# (c), where a world of 2 trains through the 20 s partition).
STEPS = 1200
STEPS_C = 2000
RESUME_WITHIN = 60.0  # seconds from the fault to training again (the bound)
FAULT_FOR = 20.0  # seconds a partition of (c) and (d) lasts
LEASE = 2.0


def job_on(hosts, tmp, steps=STEPS):
    return Job(hosts, str(tmp), steps=steps, world=3, min_world=2, every=20,
               lease=f"{LEASE:g}s", grace="2s")


def start(job):
    """The coordinator on coord, a worker on each of w1, w2, w3; until they train."""
    job.start_coordinator("coord")
    for worker in WORKERS:
        job.start_worker(worker, host=worker)
    job.wait_for_world(3)
    job.wait_for_step(100)


def check_the_end(job, reference):
    """The job finishes; its parameters equal the references; no split brain."""
    final = job.finish(seconds=180)
    undisturbed = reference.of(job)
    difference = job.compare(final, undisturbed)
    job.say(f"final parameters vs the job undisturbed in one process: largest difference "
            f"{difference:.3g}")
    assert difference <= 1e-4, f"the final parameters differ from the reference by {difference}"
    replay, restored, world = job.final_segment_reference()
    with open(final, "rb") as a, open(replay, "rb") as b:
        bitwise = a.read() == b.read()
    job.say(f"final parameters vs a run without faults that restores {restored} on {world}: "
            + ("bitwise equal" if bitwise else f"DIFFERENT ({job.compare(final, replay)})"))
    assert bitwise, f"the final parameters differ from the replay of {restored} on {world}"
    lines, generations = job.assert_no_split_brain()
    job.say(f"no split brain: {lines} log lines of training, generations {generations} in order")


def held_for(job, since, seconds, observe):
    """Keeps a fault in place until `seconds` after `since`, calling `observe(status)` on every
    poll meanwhile (the fault's duration is the test's choice, not a synchronization)."""
    def over():
        observe(job.status())
        return time.monotonic() >= since + seconds
    job.wait_for(over, seconds + 30, f"the end of a {seconds:.0f}s fault", poll=0.5)


@pytest.mark.parametrize("fault", ["pair", "from-peers"])
def test_a_worker_its_peers_cannot_reach_is_left_out_and_folded_back(tmp_path, reference, fault):
    """(a) w1 <-/-> w2, and (b) w3 cut off from w1 and w2; all still reach the coordinator."""
    with Hosts(HOSTS, rate=LINK_RATE) as hosts, job_on(hosts, tmp_path) as job:
        start(job)
        status = job.status()
        generation, after = status["generation"], job.last_sequence()
        if fault == "pair":
            hosts.partition("w1", "w2")
            candidates, link = {"w1", "w2"}, r"w1.*w2|w2.*w1"
        else:
            hosts.isolate("w3", except_=["coord"])
            candidates, link = {"w3"}, r"w3"
        status, took = job.wait_for_training_after(generation, world_size=2,
                                                   seconds=RESUME_WITHIN)
        job.say(f"training moved again with 2 ranks {took:.1f}s after the partition "
                f"(generation {status['generation']})")
        left_out = {w["id"] for w in status["workers"] if w.get("rank", -1) < 0
                    and w.get("state") == "standby"}
        assert len(left_out) == 1 and left_out <= candidates, (
            f"expected one of {sorted(candidates)} left out as a standby: {status['workers']}")
        (out,) = left_out
        unreachable = job.wait_for_event("unreachable", seconds=5, after=after, match=link)
        isolated = job.wait_for_event("isolated", seconds=5, after=after, match=out)
        job.say(f"events: unreachable '{unreachable['detail']}'; isolated "
                f"'{isolated['detail']}'")

        healed_at = job.last_sequence()
        hosts.heal()
        began = time.monotonic()
        reachable = job.wait_for_event("reachable", seconds=60, after=healed_at, match=out)
        job.wait_for_world(3, seconds=60)
        job.say(f"{out} reached every member again ('{reachable['detail']}') and was folded "
                f"back in {time.monotonic() - began:.1f}s after the heal")
        check_the_end(job, reference)


def test_a_worker_cut_off_from_the_coordinator_stops_and_rejoins(tmp_path, reference):
    """(c) w3 <-/-> coord for 20 s; w3 still reaches its peers."""
    with Hosts(HOSTS, rate=LINK_RATE) as hosts, job_on(hosts, tmp_path, STEPS_C) as job:
        start(job)
        generation = job.status()["generation"]
        began = time.monotonic()
        hosts.partition("coord", "w3")
        status, took = job.wait_for_training_after(generation, world_size=2,
                                                   seconds=FAULT_FOR)
        job.say(f"w1 and w2 trained on as a world of 2 {took:.1f}s after w3 lost the "
                f"coordinator (generation {status['generation']})")
        assert "w3" not in {w["id"] for w in status["workers"] if w.get("rank", -1) >= 0}
        held_for(job, began, FAULT_FOR, lambda status: None)
        hosts.heal()
        healed = time.monotonic()
        job.wait_for_world(3, seconds=RESUME_WITHIN)
        job.say(f"w3 back in a world of 3 {time.monotonic() - healed:.1f}s after the heal")
        check_the_end(job, reference)
        # It stopped training within its lease: its generation's end is in its log (the
        # collectives it was in failed, or it gave up on its lease) soon after the cut.
        text = job.workers["w3"].log()
        assert f"generation {generation} ended" in text, job.workers["w3"].tail(30)
        assert "has not answered for its lease" in text, job.workers["w3"].tail(30)


@pytest.mark.parametrize("cut", [["w1", "w2"], ["w1", "w2", "w3"]], ids=["two", "all"])
def test_the_coordinator_cut_off_from_workers_comes_back_to_a_world(tmp_path, reference, cut):
    """(d) coord <-/-> w1 and coord <-/-> w2 for 20 s (the workers still reach one another and
    w3 still reaches the coordinator), and the coordinator cut off from all three."""
    with Hosts(HOSTS, rate=LINK_RATE) as hosts, job_on(hosts, tmp_path) as job:
        start(job)
        generation = job.status()["generation"]
        began = time.monotonic()
        for worker in cut:
            hosts.partition("coord", worker)
        seen = []

        def observe(status):
            if status is not None:
                seen.append((round(time.monotonic() - began, 1), status.get("generation"),
                             status.get("world_size"), status.get("state"),
                             (status.get("progress") or {}).get("step")))
        held_for(job, began, FAULT_FOR, observe)
        job.say("during the partition (s, generation, world size, state, step): "
                + ", ".join(map(str, seen[::4])))
        hosts.heal()
        status, took = job.wait_for_training_after(
            generation, seconds=max(5.0, RESUME_WITHIN - (time.monotonic() - began)))
        job.say(f"training again {time.monotonic() - began:.1f}s after the partition began "
                f"(generation {status['generation']}, {status['world_size']} ranks)")
        job.wait_for_world(3, seconds=60)
        check_the_end(job, reference)
