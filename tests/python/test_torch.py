"""shard.torch end to end: a real shard-coordinator on 127.0.0.1 and torch workers running
examples/torch/mlp.py as separate processes, checked against plain torch computed here.

Run by ctest (python_torch) with SHARD_BUILD_DIR and PYTHONPATH=build/python; by hand:
    SHARD_BUILD_DIR=build PYTHONPATH=build/python /usr/bin/python3 -m pytest tests/python
"""

import json
import math
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from shard.safetensors import load_file, save_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.abspath(os.environ.get("SHARD_BUILD_DIR", os.path.join(ROOT, "build")))
BIN = os.path.join(BUILD, "bin")
EXAMPLE = os.path.join(ROOT, "examples", "torch", "mlp.py")
sys.path.insert(0, os.path.dirname(EXAMPLE))
from mlp import Mlp  # noqa: E402  (the example's model, for the reference)
# The process harness shared with bench/ and scripts/ (the other files here take it from this
# one). tests/support is no package: its directory goes on the import path, found from this file,
# since this file is imported by pytest and by the workers it starts (ddp_reference.py, ...).
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))
from shard_processes import ONE_THREAD, Processes, read_text  # noqa: E402

WIDTHS = [16, 32, 8]
SAMPLES = 512
DEADLINE = 120  # seconds any one process may take: a hang fails the test instead of CI


def wait_for(predicate, seconds, what):
    """The first true value `predicate()` returns within `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {seconds}s waiting for {what}")


class Cluster:
    """A coordinator and its workers in `tmp` (shard_processes: each with its log there, every
    one stopped by pid at the end)."""

    def __init__(self, tmp):
        self.tmp = tmp
        self.processes = Processes(tmp, BUILD)
        self.coordinator = None
        self.port = None

    def write_job(self, world, steps, min_world=None, every=0, model=None, out="out",
                  file="job.json", snapshot_every=0, **extra):
        job = {"name": "torchjob", "worldSize": world, "minWorldSize": min_world or world,
               "model": model or {"external": {}},
               "optimizer": {"name": "adam", "lr": 0.01}, "globalBatch": 24, "steps": steps,
               "zeroStage": 2, "bucketCapMb": 0.001, "firstBucketCapMb": 0.0005,
               "checkpoint": {"everySteps": every, "keepLast": 100, "dir": "checkpoints"},
               "snapshot": {"everySteps": snapshot_every}, "outputDir": out}
        job.update(extra)
        path = os.path.join(self.tmp, file)
        with open(path, "w") as f:
            json.dump(job, f)
        return path

    def start_coordinator(self, job, *extra, log_name="coordinator.log", state="state"):
        self.coordinator = self.processes.start_coordinator(
            "--lease", "1s", "--reform-grace", "1s", *extra, job=job,
            state_dir=os.path.join(self.tmp, state), log=log_name)
        self.port = self.coordinator.port

    def start_worker(self, worker_id, script=EXAMPLE, args=None, env=None):
        args = args if args is not None else ["--data", self.data, "--widths",
                                              ",".join(map(str, WIDTHS)), "--seed", "5"]
        return self.processes.start_worker(worker_id, self.coordinator.address, *args,
                                           script=script, env={**ONE_THREAD, **(env or {})})

    def log(self, proc_or_name):
        """The log of a process, or the log file of that name in `tmp`."""
        if isinstance(proc_or_name, str):
            return read_text(os.path.join(self.tmp, proc_or_name))
        return proc_or_name.log()

    def wait(self, proc):
        return proc.exit_code(DEADLINE)

    def shardctl(self, *argv):
        return subprocess.run([os.path.join(BIN, "shardctl"), "--coordinator",
                               f"127.0.0.1:{self.port}", *argv],
                              capture_output=True, text=True, timeout=60)


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(str(tmp_path))
    c.data = os.path.join(c.tmp, "data.safetensors")
    generated = subprocess.run(
        [os.path.join(BIN, "shardctl"), "data", "generate", "--widths", ",".join(map(str, WIDTHS)),
         "--samples", str(SAMPLES), "--seed", "3", "--out", c.data],
        capture_output=True, text=True, timeout=60)
    assert generated.returncode == 0, generated.stdout + generated.stderr
    with c.processes:
        yield c


OPTIMIZERS = {  # the job spec's optimizer and torch's, with the same hyper-parameters
    "adam": ({"name": "adam", "lr": 0.01}, torch.optim.Adam, {"lr": 0.01}),
    "adamw": ({"name": "adamw", "lr": 0.01, "weightDecay": 0.1}, torch.optim.AdamW,
              {"lr": 0.01, "weight_decay": 0.1}),
    "sgd": ({"name": "sgd", "lr": 0.05, "momentum": 0.9}, torch.optim.SGD,
            {"lr": 0.05, "momentum": 0.9}),
}
TRANSFORMER_ARGS = ["--vocab", "16", "--dim", "16", "--heads", "2", "--layers", "1",
                    "--context", "8", "--sequences", "64"]


class BatchNormMlp(torch.nn.Module):
    """The MLP with BatchNorm after its hidden layer: buffers (running statistics, the batch
    count) that change every step."""

    def __init__(self):
        super().__init__()
        # No bias before the norm, as usual: it would get no gradient (the norm removes the
        # mean), and Adam would turn rounding noise into full-size steps.
        self.hidden = torch.nn.Linear(WIDTHS[0], WIDTHS[1], bias=False)
        self.norm = torch.nn.BatchNorm1d(WIDTHS[1])
        self.out = torch.nn.Linear(WIDTHS[1], WIDTHS[2])

    def forward(self, x):
        return self.out(torch.relu(self.norm(self.hidden(x))))


def make_model_and_data(config):
    """The model of `config` ("mlp", "transformer", "tied": the transformer with its output
    weight tied to the token embedding, or "batchnorm") as the workers build it, its
    inputs and targets, and its loss."""
    if config["model"] in ("transformer", "tied"):
        sys.path.insert(0, os.path.dirname(EXAMPLE))
        from transformer import Gpt, markov_sequences
        data = markov_sequences(64, 8, 16, 0)
        torch.manual_seed(0)
        model = Gpt(16, 16, 2, 1, 8, tie=config["model"] == "tied")
        return (model, data[:, :-1], data[:, 1:],
                lambda logits, t: torch.nn.functional.cross_entropy(logits.reshape(-1, 16),
                                                                    t.reshape(-1)))
    data = load_file(config["data"])
    torch.manual_seed(5)
    model = BatchNormMlp() if config["model"] == "batchnorm" else Mlp(WIDTHS)
    return model, data["x"], data["y"], torch.nn.functional.cross_entropy


def torch_optimizer(config, params, zero=None):
    """torch's optimizer for `config` (single-tensor code), or ZeroRedundancyOptimizer over it."""
    _, optimizer_class, settings = OPTIMIZERS[config["optimizer"]]
    settings = dict(settings, foreach=False)
    if zero is not None:
        return zero(params, optimizer_class=optimizer_class, **settings)
    return optimizer_class(params, **settings)


def run_script(cluster, source, world, steps, **job):
    """Runs `source` (a torch training script) as the `world` workers of a job of `steps`
    steps (and the job spec's fields `job`); returns the workers, each of which exited 0."""
    script = os.path.join(cluster.tmp, "script.py")
    with open(script, "w") as f:
        f.write(source)
    cluster.start_coordinator(cluster.write_job(world=world, steps=steps, **job))
    workers = [cluster.start_worker(f"w{i}", script=script, args=[]) for i in range(world)]
    for worker in workers:
        assert cluster.wait(worker) == 0, cluster.log(worker)
    return workers


def reference(config):
    """Plain torch in one process on the whole global batch of every step."""
    torch.set_num_threads(1)
    model, inputs, targets, loss_of = make_model_and_data(config)
    optimizer = torch_optimizer(config, model.parameters())
    batch = config["batch"]
    for step in range(config["steps"]):
        idx = torch.arange(step * batch, (step + 1) * batch) % len(inputs)
        optimizer.zero_grad()
        loss_of(model(inputs[idx]), targets[idx]).backward()
        optimizer.step()
    return {name: p.detach() for name, p in model.named_parameters()}


def mlp_config(cluster, steps):
    return {"model": "mlp", "data": cluster.data, "optimizer": "adam", "steps": steps,
            "batch": 24, "stage": 2}


def exported(cluster, out="out"):
    return load_file(os.path.join(cluster.tmp, out, "final.safetensors"))


def max_difference(got, want):
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    return max(float((got[name] - want[name]).abs().max()) for name in want)


def max_relative_difference(got, want):
    """The largest difference in any tensor relative to that tensor's largest magnitude."""
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    return max(float((got[name] - want[name]).abs().max() / want[name].abs().max().clamp(min=1e-30))
               for name in want)


# Every ZeRO stage, shard mode and optimizer for the MLP, alternating 2 and 3 workers, and the
# transformer with each optimizer; one case per model and optimizer is also run with torch's
# DDP + ZeroRedundancyOptimizer.
MATRIX = [
    dict(model="mlp", stage=stage, mode=mode, optimizer=optimizer,
         world=2 + (i % 2), ddp=(stage == 2 and mode == "range"))
    for i, (stage, mode, optimizer) in enumerate(
        (stage, mode, optimizer) for stage in (0, 1, 2) for mode in ("range", "param")
        for optimizer in ("adam", "adamw", "sgd"))
] + [
    dict(model="transformer", stage=1, mode="param", optimizer="adam", world=3, ddp=True),
    dict(model="transformer", stage=2, mode="range", optimizer="adamw", world=2, ddp=True),
    dict(model="transformer", stage=0, mode="range", optimizer="sgd", world=3, ddp=True),
]


def case_id(case):
    return f"{case['model']}-w{case['world']}-zero{case['stage']}-{case['mode']}-{case['optimizer']}"


def ddp_reference(cluster, config, world):
    """The parameters torch DDP + ZeroRedundancyOptimizer reach on `world` processes."""
    out = os.path.join(cluster.tmp, "ddp.safetensors")
    store = os.path.join(cluster.tmp, "ddp-store")
    procs = [cluster.processes.start_python(
        f"ddp{r}", [os.path.join(os.path.dirname(__file__), "ddp_reference.py"), "--rank", str(r),
                    "--world", str(world), "--store", store, "--config", json.dumps(config),
                    "--out", out], env=ONE_THREAD)
        for r in range(world)]
    for proc in procs:
        assert cluster.wait(proc) == 0, proc.log()
    return load_file(out)


@pytest.mark.parametrize("case", MATRIX, ids=case_id)
def test_matches_single_process_torch_and_ddp(cluster, case):
    steps = 20
    config = dict(model=case["model"], data=cluster.data, optimizer=case["optimizer"],
                  steps=steps, batch=24, stage=case["stage"])
    cluster.start_coordinator(cluster.write_job(
        world=case["world"], steps=steps, optimizer=OPTIMIZERS[case["optimizer"]][0],
        zeroStage=case["stage"], shardMode=case["mode"]))
    if case["model"] == "transformer":
        script = os.path.join(os.path.dirname(EXAMPLE), "transformer.py")
        workers = [cluster.start_worker(f"w{i}", script=script, args=TRANSFORMER_ARGS)
                   for i in range(case["world"])]
    else:
        workers = [cluster.start_worker(f"w{i}") for i in range(case["world"])]
    for worker in workers:
        assert cluster.wait(worker) == 0, cluster.log(worker)
    got = exported(cluster)
    difference = max_relative_difference(got, reference(config))
    print(f"{case_id(case)}: against one torch process {difference:.3g}", end="")
    assert difference <= 1e-5
    if case["ddp"]:
        difference = max_relative_difference(got, ddp_reference(cluster, config, case["world"]))
        print(f", against DDP + ZeroRedundancyOptimizer {difference:.3g}", end="")
        assert difference <= 1e-5
    print()


def test_buffers_follow_rank_0_and_survive_a_restore_as_with_ddp(cluster):
    # Ten steps on two workers end with a checkpoint; a new coordinator restores it on two
    # workers for ten more. BatchNorm's running statistics are broadcast from rank 0 before every
    # step, as DDP's broadcast_buffers does, and kept in the checkpoint.
    config = dict(model="batchnorm", data=cluster.data, optimizer="adam", steps=20, batch=24,
                  stage=2)
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_worker.py")
    args = ["--config", json.dumps(config)]
    cluster.start_coordinator(cluster.write_job(world=2, steps=10, every=10))
    for proc in [cluster.start_worker(f"w{i}", script=worker, args=args) for i in range(2)]:
        assert cluster.wait(proc) == 0, cluster.log(proc)
    assert cluster.wait(cluster.coordinator) == 0, cluster.log("coordinator.log")
    cluster.start_coordinator(cluster.write_job(world=2, steps=20, every=10, file="more.json"),
                              "--restore", "latest", log_name="restored-coordinator.log")
    for proc in [cluster.start_worker(f"v{i}", script=worker, args=args) for i in range(2)]:
        assert cluster.wait(proc) == 0, cluster.log(proc)
    got = exported(cluster)
    BatchNormMlp().load_state_dict(got, strict=True)
    want = ddp_reference(cluster, config, 2)
    assert int(got["norm.num_batches_tracked"]) == 20
    del got["norm.num_batches_tracked"], want["norm.num_batches_tracked"]
    difference = max_relative_difference(got, want)
    print(f"BatchNorm on two workers, restored once, against DDP: {difference:.3g}")
    assert difference <= 1e-5


def test_rank_0s_buffers_are_broadcast_before_every_step(cluster):
    workers = run_script(cluster, COUNTER, world=2, steps=6)
    # Each forward adds rank + 1 to the buffer. From rank 0's value before every step, rank 1
    # ends at 5 * 1 + 2 = 7 (14 without the broadcast) and rank 0 at 6.
    log = cluster.log(workers[0]) + cluster.log(workers[1])
    assert "rank 0 counter 6.0" in log and "rank 1 counter 7.0" in log, log


COUNTER = '''
import torch
import shard.torch as shard


class Counting(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        self.register_buffer("counter", torch.zeros(1))

    def forward(self, x):
        self.counter += job.rank + 1
        return self.linear(x)


model = Counting()
job = shard.join()
engine = job.wrap(model)
x = torch.ones(8, 4)
for step in job.steps():
    model(x[job.batch_indices(step, len(x))]).sum().backward()
    engine.step()
print(f"rank {job.rank} counter {float(model.counter)}")
job.finish()
'''


def test_gradients_are_marked_ready_once_a_bucket_once_the_buckets_are_final(cluster):
    workers = run_script(cluster, MARK_COUNTER, world=2, steps=5)
    for worker in workers:
        log = cluster.log(worker)
        counts = json.loads(log[log.index("marks "):].split("\n")[0][len("marks "):])
        params, buckets = counts["trainable"], counts["buckets"]
        assert buckets >= 2, log  # the job's small buckets split the MLP
        # The first step marks each gradient (its ready order rebuilds the buckets); every
        # later one marks each bucket once, and no gradient on its own.
        assert counts["steps"][0] == [params, 0], log
        assert counts["steps"][1:] == [[0, buckets]] * 4, log


MARK_COUNTER = '''
import ctypes
import json
import sys

import torch
import shard.torch as shard
from shard._lib import check, lib

sys.path.insert(0, "EXAMPLES")
from mlp import Mlp

WIDTHS = WIDTHS_HERE

calls = {"param": 0, "bucket": 0}


def counting(name, key):
    function = getattr(lib, name)

    def count(*args):
        calls[key] += 1
        return function(*args)
    return count


lib.shard_mark_ready = counting("shard_mark_ready", "param")
lib.shard_mark_bucket_ready = counting("shard_mark_bucket_ready", "bucket")
torch.manual_seed(5)
model = Mlp(WIDTHS)
job = shard.join()
engine = job.wrap(model)
x, y = torch.randn(24, WIDTHS[0]), torch.randint(0, WIDTHS[-1], (24,))
steps = []
for step in job.steps():
    idx = job.batch_indices(step, len(x))
    torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
    engine.step()
    steps.append([calls["param"], calls["bucket"]])
    calls.update(param=0, bucket=0)
    text = ctypes.c_char_p()
    check(lib.shard_param_layout(job._handle, ctypes.byref(text)))
    buckets = len(json.loads(text.value)["buckets"])
print("marks " + json.dumps({"steps": steps, "trainable": len(list(model.parameters())),
                             "buckets": buckets}))
job.finish()
'''.replace("EXAMPLES", os.path.dirname(EXAMPLE)).replace("WIDTHS_HERE", str(WIDTHS))


def test_saved_on_three_workers_restores_on_two(cluster):
    # Ten steps on three workers end with a checkpoint at step 10; a new coordinator on the same
    # state directory restores it on two workers and trains steps 11-20.
    cluster.start_coordinator(cluster.write_job(world=3, steps=10, every=10))
    first = [cluster.start_worker(f"w{i}") for i in range(3)]
    for worker in first:
        assert cluster.wait(worker) == 0, cluster.log(worker)
    assert cluster.wait(cluster.coordinator) == 0, cluster.log("coordinator.log")
    cluster.start_coordinator(cluster.write_job(world=2, steps=20, every=10, file="two.json"),
                              "--restore", "latest", log_name="restored-coordinator.log")
    second = [cluster.start_worker(f"v{i}") for i in range(2)]
    for worker in second:
        assert cluster.wait(worker) == 0, cluster.log(worker)
    log = cluster.log(second[0]) + cluster.log(second[1])
    assert "restoring from checkpoint step-00000010" in log, log
    got = exported(cluster)
    Mlp(WIDTHS).load_state_dict(got, strict=True)
    difference = max_relative_difference(got, reference(mlp_config(cluster, 20)))
    print(f"saved on 3, restored on 2: relative difference against one torch process "
          f"{difference:.3g}")
    assert difference <= 1e-5


def test_frozen_parameters_stay_as_they_were(cluster):
    workers = run_script(cluster, FROZEN, world=2, steps=5)
    assert "frozen unchanged, trained moved" in cluster.log(workers[0]), cluster.log(workers[0])


FROZEN = '''
import torch
import shard.torch as shard

torch.manual_seed(1)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
model[0].weight.requires_grad_(False)
frozen, trained = model[0].weight.detach().clone(), model[2].weight.detach().clone()
job = shard.join()
engine = job.wrap(model)
x = torch.randn(64, 4, generator=torch.Generator().manual_seed(2))
for step in job.steps():
    idx = job.batch_indices(step, len(x))
    model(x[idx]).pow(2).mean().backward()
    engine.step()
if torch.equal(model[0].weight, frozen) and not torch.equal(model[2].weight, trained):
    print("frozen unchanged, trained moved")
job.finish()
'''


def test_one_worker_trains_bit_for_bit_like_plain_torch(cluster):
    cluster.start_coordinator(cluster.write_job(world=1, steps=30))
    worker = cluster.start_worker("w0")
    assert cluster.wait(worker) == 0, cluster.log(worker)
    assert cluster.wait(cluster.coordinator) == 0, cluster.log("coordinator.log")
    got, want = exported(cluster), reference(mlp_config(cluster, 30))
    # The same torch forward and backward, a reduction over one rank, and Adam with torch 2.x's
    # single-tensor arithmetic (exp_avg.lerp_): the same bits on torch 2. torch 1.13 updated
    # exp_avg with mul_ and add_ instead, which rounds differently in the last bit.
    if int(torch.__version__.split(".")[0]) >= 2:
        for name in want:
            assert torch.equal(got[name], want[name]), (name, max_difference(got, want))
    else:
        difference = max_difference(got, want)
        print(f"one worker against torch {torch.__version__}: max |difference| {difference:.3g}")
        assert difference < 1e-6


def test_two_workers_equal_one_process_on_the_global_batch(cluster):
    cluster.start_coordinator(cluster.write_job(world=2, steps=30))
    workers = [cluster.start_worker("w0"), cluster.start_worker("w1")]
    for worker in workers:
        assert cluster.wait(worker) == 0, cluster.log(worker)
    assert cluster.wait(cluster.coordinator) == 0, cluster.log("coordinator.log")
    log = cluster.log(workers[0]) + cluster.log(workers[1])
    assert "parameters written to" in log
    # Averaged gradients of two halves differ from one mean over the whole batch only by
    # rounding; Adam's normalised steps keep that at float32 rounding level after 30 steps.
    difference = max_difference(exported(cluster), reference(mlp_config(cluster, 30)))
    print(f"two workers against one process: max |difference| {difference:.3g}")
    assert difference < 1e-5


# The MLP's buckets are small and go through the shared-memory slots; the tied transformer's
# buckets of 1 MiB and more are shared with the peers, which read them in place under the
# tensors that view them.
SHARED_BUCKETS_MODEL = dict(
    script=os.path.join(os.path.dirname(EXAMPLE), "transformer.py"),
    args=["--vocab", "16", "--dim", "192", "--heads", "2", "--layers", "1", "--context", "8",
          "--sequences", "64", "--tie"],
    job=dict(bucketCapMb=4, firstBucketCapMb=4, minBuckets=1))


def shared_memory_mappings(pid):
    """How many of process `pid`'s mappings are the shared-memory transport's segments: one per
    rank's slots, and as many again for each bucket shared with the peers."""
    try:
        with open(f"/proc/{pid}/maps") as maps:
            return sum("/dev/shm/shard-" in line for line in maps)
    except OSError:  # ended
        return 0


@pytest.mark.parametrize("model", ["mlp", "shared-buckets"])
def test_shared_memory_and_tcp_give_the_same_bits(cluster, model):
    # Three workers, where the order of adding up matters: both transports add the ranks'
    # gradients in the same order, so the trained parameters are the same bits.
    shared = model == "shared-buckets"
    results = {}
    for transport, backend in (("tcp", "gloo"), ("auto", "shm")):
        cluster.start_coordinator(
            cluster.write_job(world=3, steps=100 if shared else 20, out=f"out-{transport}",
                              file=f"job-{transport}.json",
                              **(SHARED_BUCKETS_MODEL["job"] if shared else {})),
            log_name=f"coordinator-{transport}.log", state=f"state-{transport}")
        workers = [cluster.start_worker(
            f"{transport}{i}", env={"SHARD_TRANSPORT": transport},
            **({"script": SHARED_BUCKETS_MODEL["script"], "args": SHARED_BUCKETS_MODEL["args"]}
               if shared else {}))
                   for i in range(3)]
        if shared and backend == "shm":
            # 3 ranks' slots, and the bucket's parameters and gradients of every rank besides.
            wait_for(lambda: shared_memory_mappings(workers[0].pid) >= 9, DEADLINE,
                     "the buckets shared with the peers in the first worker's mappings")
        for worker in workers:
            assert cluster.wait(worker) == 0, cluster.log(worker)
            assert f"over 3 ranks ({backend})" in cluster.log(worker), cluster.log(worker)
        assert cluster.wait(cluster.coordinator) == 0
        results[transport] = exported(cluster, f"out-{transport}")
    for name in results["tcp"]:
        assert torch.equal(results["auto"][name], results["tcp"][name]), (
            name, max_difference(results["auto"], results["tcp"]))


# A /dev/shm with room for the transport's slots (4 MiB per rank) but not for the buckets.
SMALL_DEV_SHM = "10m"
IN_SMALL_DEV_SHM = "SHARD_TEST_IN_SMALL_DEV_SHM"


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/unshare"),
                    reason="mounts a small /dev/shm in a mount namespace of its own (root)")
def test_buckets_a_full_dev_shm_cannot_share_are_warned_of_and_train_the_same_bits(tmp_path):
    # The test below, in a private mount namespace whose /dev/shm is a small tmpfs: every
    # process it starts sees that one, and the machine's own /dev/shm is untouched.
    inner = subprocess.run(
        ["/usr/bin/unshare", "--mount", "--propagation", "private", "sh", "-c",
         f"mount -t tmpfs -o size={SMALL_DEV_SHM} shard-test-shm /dev/shm && exec "
         f"{sys.executable} -m pytest -q -p no:cacheprovider --basetemp {tmp_path / 'inner'} "
         f"{os.path.abspath(__file__)}::test_in_a_small_dev_shm_buckets_copy_through_the_slots"],
        env={**os.environ, IN_SMALL_DEV_SHM: "1"}, capture_output=True, text=True,
        timeout=4 * DEADLINE)
    assert inner.returncode == 0 and "1 passed" in inner.stdout, inner.stdout + inner.stderr


@pytest.mark.skipif(IN_SMALL_DEV_SHM not in os.environ,
                    reason="run by the test above, in a small /dev/shm of its own")
def test_in_a_small_dev_shm_buckets_copy_through_the_slots(cluster):
    results = {}
    for transport, backend in (("tcp", "gloo"), ("auto", "shm")):
        cluster.start_coordinator(
            cluster.write_job(world=2, steps=20, out=f"out-{transport}",
                              file=f"job-{transport}.json", **SHARED_BUCKETS_MODEL["job"]),
            log_name=f"coordinator-{transport}.log", state=f"state-{transport}")
        workers = [cluster.start_worker(f"{transport}{i}", env={"SHARD_TRANSPORT": transport},
                                        script=SHARED_BUCKETS_MODEL["script"],
                                        args=SHARED_BUCKETS_MODEL["args"])
                   for i in range(2)]
        for worker in workers:
            assert cluster.wait(worker) == 0, cluster.log(worker)
            log = cluster.log(worker)
            assert f"over 2 ranks ({backend})" in log, log
            if backend == "shm":
                # Said at the step whose plan could not share them, not only in the summary.
                warning = re.search(r"step (\d+): the buckets are not shared with this host's "
                                    r"other ranks \((.*)\); their collectives copy through", log)
                assert warning and int(warning.group(1)) <= 2, log
                assert "/dev/shm" in warning.group(2) or "a peer" in warning.group(2), log
                assert "buckets copied through the shared-memory slots" in log, log
        assert cluster.wait(cluster.coordinator) == 0
        results[transport] = exported(cluster, f"out-{transport}")
    for name in results["tcp"]:
        assert torch.equal(results["auto"][name], results["tcp"][name]), (
            name, max_difference(results["auto"], results["tcp"]))


def test_micro_batches_accumulate_and_reduce_once_per_step(cluster):
    cluster.start_coordinator(cluster.write_job(world=2, steps=20))
    args = ["--data", cluster.data, "--widths", ",".join(map(str, WIDTHS)), "--seed", "5",
            "--micro-batches", "3"]
    workers = [cluster.start_worker(f"w{i}", args=args) for i in range(2)]
    for worker in workers:
        assert cluster.wait(worker) == 0, cluster.log(worker)
    difference = max_difference(exported(cluster), reference(mlp_config(cluster, 20)))
    print(f"3 micro-batches on two workers against one process: max |difference| {difference:.3g}")
    assert difference < 1e-5


def test_a_killed_worker_is_survived_and_the_result_equals_uninterrupted_training(cluster):
    steps = 400
    cluster.start_coordinator(cluster.write_job(world=3, min_world=2, steps=steps, every=20))
    workers = [cluster.start_worker(f"w{i}") for i in range(3)]
    checkpoints = os.path.join(cluster.tmp, "checkpoints", "torchjob")

    def committed():
        return os.path.isdir(checkpoints) and any(
            os.path.exists(os.path.join(checkpoints, c, "manifest.json"))
            for c in os.listdir(checkpoints))

    wait_for(committed, 60, "a committed checkpoint")
    victim = workers[1]
    victim.kill()
    survivors = [workers[0], workers[2]]
    for worker in survivors:
        assert cluster.wait(worker) == 0, cluster.log(worker)
    assert cluster.wait(cluster.coordinator) == 0, cluster.log("coordinator.log")
    events = cluster.log("coordinator.log")
    assert re.search(r"worker w1 \(rank \d\) declared dead", events), events
    assert "re-forming with 2 of the 3 ranks" in events, events
    restores = {m for w in survivors
                for m in re.findall(r"restoring from checkpoint (\S+)", cluster.log(w))}
    assert len(restores) == 1, restores
    # The reference: a new run that restores the same checkpoint on two workers and trains to
    # the end undisturbed. The re-formed run lost no step and repeated none: the same bits.
    cluster.start_coordinator(
        cluster.write_job(world=2, steps=steps, out="reference", file="reference.json"),
        "--restore", restores.pop(), log_name="reference-coordinator.log")
    references = [cluster.start_worker(f"ref{i}") for i in range(2)]
    for worker in references:
        assert cluster.wait(worker) == 0, cluster.log(worker)
    got, want = exported(cluster), exported(cluster, "reference")
    for name in want:
        assert torch.equal(got[name], want[name]), (name, max_difference(got, want))


@pytest.mark.parametrize("stage", [2, 3])
def test_a_killed_worker_is_recovered_from_memory_with_no_checkpoint_on_disk(cluster, stage):
    steps = 400
    cluster.start_coordinator(cluster.write_job(world=3, min_world=2, steps=steps,
                                                snapshot_every=10, zeroStage=stage))
    workers = [cluster.start_worker(f"w{i}") for i in range(3)]

    def snapshot_taken():
        status = cluster.shardctl("status", "--json")
        return (status.returncode == 0 and
                json.loads(status.stdout)["progress"]["last_snapshot_step"] >= 20)

    wait_for(snapshot_taken, 60, "a snapshot in memory")
    workers[1].kill()
    survivors = [workers[0], workers[2]]
    for worker in survivors:
        assert cluster.wait(worker) == 0, cluster.log(worker)
    assert cluster.wait(cluster.coordinator) == 0, cluster.log("coordinator.log")
    assert not os.path.exists(os.path.join(cluster.tmp, "checkpoints")), "nothing went to disk"
    restored = {int(m) for w in survivors
                for m in re.findall(r"restored memory snapshot \S+ \(step (\d+)\)",
                                    cluster.log(w))}
    assert len(restored) == 1, restored
    step = restored.pop()
    # The reference: three workers to that step through a checkpoint, then two to the end.
    cluster.start_coordinator(
        cluster.write_job(world=3, steps=step, every=step, out="reference-3",
                          file="reference-3.json", zeroStage=stage),
        log_name="reference-3-coordinator.log")
    for worker in [cluster.start_worker(f"three{i}") for i in range(3)]:
        assert cluster.wait(worker) == 0, cluster.log(worker)
    (checkpoint,) = os.listdir(os.path.join(cluster.tmp, "checkpoints", "torchjob"))
    cluster.start_coordinator(
        cluster.write_job(world=2, steps=steps, out="reference", file="reference.json",
                          zeroStage=stage),
        "--restore", checkpoint, log_name="reference-coordinator.log")
    for worker in [cluster.start_worker(f"two{i}") for i in range(2)]:
        assert cluster.wait(worker) == 0, cluster.log(worker)
    got, want = exported(cluster), exported(cluster, "reference")
    for name in want:
        assert torch.equal(got[name], want[name]), (name, max_difference(got, want))


@pytest.mark.parametrize("stage", [2, 3])
def test_the_transformer_with_groups_schedule_and_clipping_equals_plain_torch(cluster, stage):
    sys.path.insert(0, os.path.dirname(EXAMPLE))
    from transformer import Gpt, markov_sequences
    steps, lr, warmup, min_lr = 30, 0.003, 5, 0.0003
    optimizer = {"name": "adamw", "lr": lr, "betas": [0.9, 0.95], "weightDecay": 0.1,
                 "paramGroups": [{"match": ["*.bias", "*ln*", "*emb*"], "weightDecay": 0}],
                 "schedule": {"warmupSteps": warmup, "decay": "cosine", "minLr": min_lr}}
    cluster.start_coordinator(cluster.write_job(world=2, steps=steps, optimizer=optimizer,
                                                gradClipNorm=0.5, globalBatch=8, zeroStage=stage))
    script = os.path.join(os.path.dirname(EXAMPLE), "transformer.py")
    tiny = ["--vocab", "16", "--dim", "16", "--heads", "2", "--layers", "1", "--context", "8",
            "--sequences", "64"]
    workers = [cluster.start_worker(f"w{i}", script=script, args=tiny) for i in range(2)]
    for worker in workers:
        assert cluster.wait(worker) == 0, cluster.log(worker)

    # Plain torch: AdamW with a no-decay group, LambdaLR with the same warm-up and cosine
    # (docs/training.md), clip_grad_norm_, on the whole global batch.
    torch.manual_seed(0)
    model = Gpt(16, 16, 2, 1, 8)
    data = markov_sequences(64, 8, 16, 0)
    no_decay = [p for n, p in model.named_parameters()
                if n.endswith(".bias") or "ln" in n or "emb" in n]
    decay = [p for n, p in model.named_parameters()
             if not (n.endswith(".bias") or "ln" in n or "emb" in n)]
    adamw = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                               {"params": no_decay, "weight_decay": 0.0}],
                              lr=lr, betas=(0.9, 0.95), foreach=False)

    def factor(s):  # update s, 1-based
        if s <= warmup:
            return s / warmup
        p = min(1.0, (s - warmup) / (steps - warmup))
        m = min_lr / lr
        return m + (1 - m) * (0.5 * (1 + math.cos(math.pi * p)))

    schedule = torch.optim.lr_scheduler.LambdaLR(adamw, lambda c: factor(c + 1))
    for step in range(steps):
        batch = data[torch.arange(step * 8, (step + 1) * 8) % len(data)]
        adamw.zero_grad()
        logits = model(batch[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, 16), batch[:, 1:].reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        adamw.step()
        schedule.step()
    got = exported(cluster)
    shard_model = Gpt(16, 16, 2, 1, 8)
    shard_model.load_state_dict(got, strict=True)
    difference = max_difference(got, {n: p.detach() for n, p in model.named_parameters()})
    print(f"transformer at stage {stage} on two workers against plain torch: max |difference| "
          f"{difference:.3g}")
    assert difference < 1e-5


def test_misuse_is_a_clear_error(cluster):
    (worker,) = run_script(cluster, MISUSE, world=1, steps=3)
    log = cluster.log(worker)
    for expected in ("fp32 parameters", "is on meta but this rank trains on cpu: move the model",
                     "this job trains on the host, which has no streams",
                     "wrap() was called already",
                     "no longer Shard's buffer: do not call zero_grad(set_to_none=True)",
                     "do not move or replace the model's parameters",
                     "changed after backward made it (clip_grad_norm_"):
        assert expected in log, (expected, log)


MISUSE = '''
import torch
import shard.torch as shard

job = shard.join()
for wrong in (torch.nn.Linear(4, 2).double(), torch.nn.Linear(4, 2, device="meta")):
    try:
        job.wrap(wrong)
    except shard.ShardError as e:
        print(e)
try:
    shard.check(shard.lib.shard_set_stream(job._handle, 1))
except shard.ShardError as e:
    print(e)
model = torch.nn.Linear(4, 2)
engine = job.wrap(model)
try:
    job.wrap(model)
except shard.ShardError as e:
    print(e)
x = torch.ones(8, 4)
for step in job.steps():
    if step == 0:
        saved = model.weight.data
        model.weight.data = saved.clone()
        model(x).sum().backward()
        try:
            engine.step()
        except shard.ShardError as e:
            print(e)
        model.weight.data = saved
        engine.step()
    elif step == 1:
        model(x).sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)  # the job spec's gradClipNorm
        try:
            engine.step()
        except shard.ShardError as e:
            print(e)
        engine.step()
    else:
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()
        try:
            engine.step()
        except shard.ShardError as e:
            print(e)
        break
job.close()
'''


def test_a_generation_ended_wrongly_is_still_handed_back(cluster):
    (worker,) = run_script(cluster, END_TOO_EARLY, world=1, steps=3)
    log = cluster.log(worker)
    # The end failed (code 0 before the last step) but handed the generation back with that
    # error: the worker failed the job with it instead of waiting for the generation forever
    # (and the next begin says so, not that a generation is still being trained).
    failure = "the generation ended neither paused nor finished (step 0 of 3)"
    assert f"end: 9 {failure}" in log, log
    assert f"begin: 9 training failed: {failure}" in log, log


END_TOO_EARLY = '''
import ctypes
import os
import torch
import shard.torch as shard


def say(*parts):
    # One write for the whole line: the worker's own log lines go to the same file and must
    # not land inside it (print may write its parts separately).
    os.write(1, (" ".join(str(part) for part in parts) + "\\n").encode())


job = shard.join()
job.wrap(torch.nn.Linear(4, 2))
began, needs_init, path = ctypes.c_int(), ctypes.c_int(), ctypes.c_char_p()
shard.check(shard.lib.shard_generation_begin(job._handle, ctypes.byref(began),
                                             ctypes.byref(needs_init)))
assert began.value
code = shard.lib.shard_generation_end(job._handle, 0, b"", ctypes.byref(path))
say("end:", code, shard.lib.shard_last_error().decode())
code = shard.lib.shard_generation_begin(job._handle, ctypes.byref(began), ctypes.byref(needs_init))
say("begin:", code, shard.lib.shard_last_error().decode())
job.close()
'''


def test_a_gpu_that_is_not_there_is_a_clear_error_at_join():
    # This machine has no GPU: a build with CUDA says the device is not there, one without
    # says it was built without. Both refuse before contacting the coordinator.
    import shard.torch as shard
    with pytest.raises(shard.ShardError) as refused:
        shard.join(coordinator="127.0.0.1:9", worker_id="w0", device="cuda:0")
    assert refused.value.code == 9, refused.value  # FAILED_PRECONDITION
    assert "cuda:0" in str(refused.value) and "device cpu" in str(refused.value), refused.value


def test_workers_with_different_models_are_refused_naming_the_parameter(cluster):
    cluster.start_coordinator(cluster.write_job(world=2, steps=5))
    first = cluster.start_worker("w0")
    # The same layers but a wider hidden layer: layers.0.weight is [48, 16], not [32, 16].
    other = cluster.start_worker("w1", args=["--data", cluster.data, "--widths", "16,48,8"])
    # Whichever registers second is refused (the other waits for a worker with its model).
    wait_for(lambda: first.poll() is not None or other.poll() is not None, DEADLINE,
             "a worker to be refused")
    refused = first if first.poll() is not None else other
    assert refused.returncode != 0
    log = cluster.log(refused)
    assert "every worker must run the same model" in log and "layers.0.weight" in log, log


def test_the_wrong_worker_for_the_job_says_what_to_start(cluster):
    mlp = {"mlp": {"widths": WIDTHS}}
    cluster.start_coordinator(cluster.write_job(world=1, steps=3, model=mlp,
                                                data={"path": cluster.data}))
    worker = cluster.start_worker("w0")
    assert cluster.wait(worker) != 0
    assert "built-in MLP" in cluster.log(worker), cluster.log(worker)
    assert cluster.shardctl("stop").returncode == 0
    assert cluster.wait(cluster.coordinator) == 0


def test_the_export_loads_into_the_model_and_a_state_dict_starts_a_job(cluster):
    init = os.path.join(cluster.tmp, "init.safetensors")
    torch.manual_seed(99)
    start = Mlp(WIDTHS)
    save_file(start.state_dict(), init)
    cluster.start_coordinator(cluster.write_job(world=1, steps=5, init={"path": init}))
    worker = cluster.start_worker("w0")
    assert cluster.wait(worker) == 0, cluster.log(worker)
    model = Mlp(WIDTHS)
    model.load_state_dict(exported(cluster), strict=True)
    # Fine-tuning started from the saved state_dict, not from the script's seed: five small Adam
    # steps stay close to it.
    moved = max(float((a - b).abs().max())
                for a, b in zip(model.state_dict().values(), start.state_dict().values()))
    assert 0 < moved < 0.1, moved


# ZeRO stage 3 through shard.torch (shard.units): the default unit policy at the test's tiny
# buckets makes each block, its linear layers and the embeddings units of their own.
STAGE3 = [
    dict(model="mlp", world=3, mode="range", optimizer="adam"),
    dict(model="transformer", world=2, mode="range", optimizer="adamw"),
    dict(model="transformer", world=3, mode="param", optimizer="adam"),
    dict(model="tied", world=2, mode="range", optimizer="adam"),
    dict(model="tied", world=3, mode="param", optimizer="sgd"),
]


def start_workers(cluster, model, world, extra=()):
    if model == "mlp":
        return [cluster.start_worker(f"w{i}") for i in range(world)]
    if model == "batchnorm":
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_worker.py")
        args = ["--config", json.dumps(dict(model=model, data=cluster.data))]
        return [cluster.start_worker(f"w{i}", script=script, args=args) for i in range(world)]
    script = os.path.join(os.path.dirname(EXAMPLE), "transformer.py")
    args = TRANSFORMER_ARGS + (["--tie"] if model == "tied" else []) + list(extra)
    return [cluster.start_worker(f"w{i}", script=script, args=args) for i in range(world)]


@pytest.mark.parametrize("case", STAGE3, ids=lambda c: f"{c['model']}-w{c['world']}-{c['mode']}-"
                         f"{c['optimizer']}")
def test_stage_3_matches_single_process_torch(cluster, case):
    steps = 20
    config = dict(model=case["model"], data=cluster.data, optimizer=case["optimizer"],
                  steps=steps, batch=24)
    cluster.start_coordinator(cluster.write_job(
        world=case["world"], steps=steps, optimizer=OPTIMIZERS[case["optimizer"]][0],
        zeroStage=3, shardMode=case["mode"]))
    workers = start_workers(cluster, case["model"], case["world"])
    for worker in workers:
        assert cluster.wait(worker) == 0, cluster.log(worker)
    got = exported(cluster)
    want = reference(config)
    if case["model"] == "tied":  # the export has both names of the tied weight
        want["head.weight"] = want["token_emb.weight"]
        assert torch.equal(got["head.weight"], got["token_emb.weight"])
    difference = max_relative_difference(got, want)
    print(f"stage 3 {case}: against one torch process {difference:.3g}")
    assert difference <= 1e-5


@pytest.mark.parametrize("model,extra", [("tied", []), ("tied", ["--bf16"]), ("batchnorm", [])],
                         ids=["tied", "tied-bf16-autocast", "batchnorm-buffers"])
def test_stage_3_equals_stage_2_bit_for_bit(cluster, model, extra):
    # The same world, model and data: gathering the parameters on demand changes no bit, with
    # bf16 autocast (on the CPU) and with module buffers (BatchNorm's, broadcast every step) too.
    results = {}
    for stage in (2, 3):
        cluster.start_coordinator(
            cluster.write_job(world=2, steps=20, zeroStage=stage, out=f"out{stage}",
                              file=f"job{stage}.json"),
            log_name=f"coordinator{stage}.log", state=f"state{stage}")
        for worker in start_workers(cluster, model, 2, extra):
            assert cluster.wait(worker) == 0, cluster.log(worker)
        assert cluster.wait(cluster.coordinator) == 0, cluster.log(f"coordinator{stage}.log")
        results[stage] = exported(cluster, f"out{stage}")
    for name in results[2]:
        assert torch.equal(results[3][name], results[2][name]), (
            name, max_difference(results[3], results[2]))


def test_saved_at_stage_3_on_three_restores_at_stage_2_on_two(cluster):
    cluster.start_coordinator(cluster.write_job(world=3, steps=10, every=10, zeroStage=3))
    for worker in start_workers(cluster, "tied", 3):
        assert cluster.wait(worker) == 0, cluster.log(worker)
    assert cluster.wait(cluster.coordinator) == 0, cluster.log("coordinator.log")
    cluster.start_coordinator(cluster.write_job(world=2, steps=20, every=10, zeroStage=2,
                                                file="two.json"),
                              "--restore", "latest", log_name="restored-coordinator.log")
    second = start_workers(cluster, "tied", 2)
    for worker in second:
        assert cluster.wait(worker) == 0, cluster.log(worker)
    assert "restoring from checkpoint step-00000010" in cluster.log(second[0])
    got = exported(cluster)
    want = reference(dict(model="tied", optimizer="adam", steps=20, batch=24))
    want["head.weight"] = want["token_emb.weight"]
    difference = max_relative_difference(got, want)
    print(f"stage 3 on 3 workers, restored at stage 2 on 2: against one torch process "
          f"{difference:.3g}")
    assert difference <= 1e-5


STAGE3_SCRIPT = """
import contextlib
import sys
import torch
import shard.torch as shard
from shard.safetensors import load_file, save_file

torch.set_num_threads(1)


class Reuse(torch.nn.Module):
    # One unit called twice in a forward, a frozen parameter, and a unit per layer.
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(16, 32)
        self.shared = torch.nn.Linear(32, 32)
        self.out = torch.nn.Linear(32, 8)
        self.offset = torch.nn.Parameter(torch.linspace(-1, 1, 8), requires_grad=False)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        h = torch.relu(self.shared(h))
        h = torch.relu(self.shared(h))
        return self.out(h) + self.offset


data = load_file(sys.argv[1])
torch.manual_seed(5)
model = Reuse()
job = shard.join()
engine = job.wrap(model, units=[model.inp, model.shared, model.out])
trainable = [p for p in model.parameters() if p.requires_grad]
for step in job.steps():
    idx = job.batch_indices(step, len(data["x"]))
    for micro in range(2):  # two micro-batches: the first accumulates without reducing
        part = idx[micro * len(idx) // 2:(micro + 1) * len(idx) // 2]
        context = engine.no_sync() if micro == 0 else contextlib.nullcontext()
        with context:
            loss = torch.nn.functional.cross_entropy(model(data["x"][part]), data["y"][part]) / 2
            loss.backward()
    # Outside forward no rank holds a trainable parameter: each is an expanded placeholder.
    assert all(all(s == 0 for s in p.stride()) for p in trainable), [p.stride() for p in trainable]
    engine.step()
    if step == 9:
        state = engine.consolidated_state_dict()
        if job.rank == 0:
            save_file(state["model"], sys.argv[2] + "/consolidated.safetensors")
path = job.finish()
if job.rank == 0:
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              sys.argv[2] + "/after.safetensors")
print("stage 3 script done")
"""


def test_stage_3_reuses_a_unit_accumulates_micro_batches_and_keeps_frozen_parameters(cluster):
    script = os.path.join(cluster.tmp, "script.py")
    with open(script, "w") as f:
        f.write(STAGE3_SCRIPT)
    cluster.start_coordinator(cluster.write_job(world=2, steps=10, zeroStage=3))
    workers = [cluster.start_worker(f"w{i}", script=script, args=[cluster.data, cluster.tmp])
               for i in range(2)]
    for worker in workers:
        assert cluster.wait(worker) == 0, cluster.log(worker)
        assert "stage 3 script done" in cluster.log(worker)

    # Plain torch on the whole global batch of every step.
    data = load_file(cluster.data)
    namespace = {}
    exec(STAGE3_SCRIPT.split("data = load_file")[0].split("torch.set_num_threads(1)")[1],
         {"torch": torch}, namespace)
    torch.manual_seed(5)
    model = namespace["Reuse"]()
    adam = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.01,
                            foreach=False)
    for step in range(10):
        idx = torch.arange(step * 24, (step + 1) * 24) % len(data["x"])
        adam.zero_grad()
        torch.nn.functional.cross_entropy(model(data["x"][idx]), data["y"][idx]).backward()
        adam.step()
    want = {name: value.detach() for name, value in model.state_dict().items()}
    got = exported(cluster)
    difference = max_relative_difference(got, want)
    print(f"stage 3, a unit used twice, 2 micro-batches: against one torch process "
          f"{difference:.3g}")
    assert difference <= 1e-5
    # The consolidated state dict of the last step and the model after finish() are the export.
    for other in ("consolidated", "after"):
        values = load_file(os.path.join(cluster.tmp, f"{other}.safetensors"))
        for name in want:
            assert torch.equal(values[name], got[name]), (other, name)


OUTSIDE_UNIT = """
import torch
import shard.torch as shard

torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
job = shard.join()
engine = job.wrap(model, units=[model[0], model[1]])
for step in job.steps():
    loss = model(torch.ones(2, 4)).sum() + (model[1].weight ** 2).sum()  # L2 outside forward
    loss.backward()
    engine.step()
job.finish()
"""


def test_stage_3_refuses_a_parameter_used_outside_its_units_forward(cluster):
    script = os.path.join(cluster.tmp, "outside.py")
    with open(script, "w") as f:
        f.write(OUTSIDE_UNIT)
    cluster.start_coordinator(cluster.write_job(world=1, steps=2, zeroStage=3))
    worker = cluster.start_worker("w0", script=script, args=[])
    assert cluster.wait(worker) != 0
    log = cluster.log(worker)
    assert "used outside the forward of the unit that holds it" in log and "units=" in log, log
