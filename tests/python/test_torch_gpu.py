"""shard.torch on a GPU (cuda:0): the same real coordinator and torch workers as test_torch.py,
each run checked against plain torch on the same GPU. Skipped where torch has no CUDA device
(Debian's torch is CPU-only); scripts/gpu-cluster-test.sh runs it on a GPU machine.
"""

import os

import pytest
import torch

from shard.safetensors import load_file
from test_torch import (WIDTHS, Mlp, cluster, exported, max_difference,  # noqa: F401 (fixture)
                        wait_for)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")

STEPS = 30
GLOBAL_BATCH = 24  # Cluster.write_job's


def gpu_reference(data_path, steps, bf16=False):
    """Plain torch on cuda:0, one process on the whole global batch of every step, as
    examples/torch/mlp.py computes it (seed 5, Adam lr 0.01 with torch's single-tensor code)."""
    device = torch.device("cuda:0")
    data = load_file(data_path)
    x, y = data["x"].to(device), data["y"].to(device)
    torch.manual_seed(5)
    model = Mlp(WIDTHS).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, foreach=False)
    for step in range(steps):
        idx = (torch.arange(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH) % len(x)).to(device)
        optimizer.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        optimizer.step()
    return {name: p.detach().cpu() for name, p in model.named_parameters()}


def train(cluster, monkeypatch, world, backend="auto", extra=(), script=None, **job):
    """A job of `world` torch workers on cuda:0 (examples/torch/mlp.py unless `script`; the job
    spec's fields `job`); returns the workers' logs once every process exited 0."""
    monkeypatch.setenv("SHARD_DEVICE", "cuda:0")
    monkeypatch.setenv("SHARD_BACKEND", backend)
    cluster.start_coordinator(cluster.write_job(world=world, steps=STEPS, **job))
    args = ["--data", cluster.data, "--widths", ",".join(map(str, WIDTHS)), "--seed", "5", *extra]
    if script is not None:
        path = os.path.join(cluster.tmp, "script.py")
        with open(path, "w") as f:
            f.write(script)
        workers = [cluster.start_worker(f"w{i}", script=path, args=args) for i in range(world)]
    else:
        workers = [cluster.start_worker(f"w{i}", args=args) for i in range(world)]
    for worker in workers:
        assert cluster.wait(worker) == 0, cluster.log(worker)
    assert cluster.wait(cluster.coordinator) == 0, cluster.log("coordinator.log")
    return [cluster.log(worker) for worker in workers]


def test_nccl_world_of_one_equals_plain_torch_on_the_gpu(cluster, monkeypatch):
    (log,) = train(cluster, monkeypatch, world=1)
    assert "on cuda:0 over nccl" in log, log
    # The same forward and backward kernels; only Adam's last bits may differ (Shard's fused
    # step rounds like torch's CPU code, torch's CUDA kernels may contract into FMAs).
    difference = max_difference(exported(cluster), gpu_reference(cluster.data, STEPS))
    print(f"NCCL world of one against plain torch on the GPU: max |difference| {difference:.3g}")
    assert difference < 1e-5


def test_two_staged_ranks_sharing_the_gpu_equal_one_process_there(cluster, monkeypatch):
    logs = train(cluster, monkeypatch, world=2, backend="gloo")
    assert all("over gloo+staged" in log for log in logs), logs
    difference = max_difference(exported(cluster), gpu_reference(cluster.data, STEPS))
    print(f"two staged ranks against one process on the GPU: max |difference| {difference:.3g}")
    assert difference < 1e-5


@pytest.mark.parametrize("world,backend", [(1, "auto"), (2, "gloo")])
def test_zero_stage_3_on_the_gpu_equals_plain_torch_there(cluster, monkeypatch, world, backend):
    train(cluster, monkeypatch, world=world, backend=backend, zeroStage=3)
    difference = max_difference(exported(cluster), gpu_reference(cluster.data, STEPS))
    print(f"stage 3, {world} rank(s) on the GPU, against plain torch there: max |difference| "
          f"{difference:.3g}")
    assert difference < 1e-5


def test_bf16_autocast_follows_plain_torch_under_the_same_autocast(cluster, monkeypatch):
    train(cluster, monkeypatch, world=1, extra=["--bf16"])
    got = exported(cluster)
    bf16 = gpu_reference(cluster.data, STEPS, bf16=True)
    fp32 = gpu_reference(cluster.data, STEPS)
    to_bf16, fp32_to_bf16 = max_difference(got, bf16), max_difference(fp32, bf16)
    print(f"bf16 autocast: against plain torch in bf16 {to_bf16:.3g}, "
          f"plain torch fp32 against bf16 {fp32_to_bf16:.3g}")
    # Autocast really ran (fp32 ends elsewhere), and Shard follows torch's bf16 run far closer
    # than fp32 does: bf16's rounding of slightly different weights is all that separates them.
    assert to_bf16 < 5e-3
    assert to_bf16 < fp32_to_bf16 / 4


SIDE_STREAM = '''
import argparse
import torch
import shard.torch as shard
from shard.safetensors import load_file
from mlp import Mlp

parser = argparse.ArgumentParser()
parser.add_argument("--data")
parser.add_argument("--widths")
parser.add_argument("--seed", type=int)
args = parser.parse_args()
data = load_file(args.data)
torch.manual_seed(args.seed)
model = Mlp([int(w) for w in args.widths.split(",")])
job = shard.join()
model.to(job.device)
x, y = data["x"].to(job.device), data["y"].to(job.device)
engine = job.wrap(model)
side = torch.cuda.Stream(job.device)
side.wait_stream(torch.cuda.current_stream(job.device))
with torch.cuda.stream(side):  # every step on a stream of the script's own
    for step in job.steps():
        idx = job.batch_indices(step, len(x)).to(job.device)
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        engine.step()
        job.report(loss=loss.item())
job.finish()
'''


def test_training_on_a_stream_of_the_scripts_own_is_ordered_with_it(cluster, monkeypatch):
    # Shard orders its work after the stream torch computes on (events, no device-wide
    # synchronization): were it ordered with the default stream only, the update would race
    # with backward on the side stream and the result would not match.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [os.path.dirname(os.path.abspath(__file__)) + "/../../examples/torch",
         os.environ.get("PYTHONPATH", "")]))
    train(cluster, monkeypatch, world=1, script=SIDE_STREAM)
    difference = max_difference(exported(cluster), gpu_reference(cluster.data, STEPS))
    print(f"on a side stream against plain torch on the GPU: max |difference| {difference:.3g}")
    assert difference < 1e-5


@pytest.mark.parametrize("name,mode", [("AdamW", "range"), ("Factored", "param")])
def test_the_scripts_own_optimizer_on_the_gpu_equals_plain_torch_there(cluster, monkeypatch,
                                                                         name, mode):
    # The class runs on views of Shard's device buffers (two staged ranks sharing the GPU).
    from test_torch_optim import config_of, max_relative_difference, parameters, reference, train
    monkeypatch.setenv("SHARD_DEVICE", "cuda:0")
    monkeypatch.setenv("SHARD_BACKEND", "gloo")
    config = config_of(cluster, name)
    train(cluster, config, 2, STEPS, mode)
    model, _ = reference(config, STEPS, device="cuda:0")
    difference = max_relative_difference(exported(cluster), parameters(model))
    print(f"{name} in {mode} mode on two staged GPU ranks against plain torch on the GPU: "
          f"{difference:.3g}")
    assert difference <= 1e-5
