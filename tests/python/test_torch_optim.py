"""shard.torch with the script's own torch.optim class (engine.optimizer, job spec "optimizer":
{"name": "torch"}): real coordinator and worker processes (optim_worker.py) against plain torch
computed here with the same class, groups and LambdaLR warm-up.

Run by ctest (python_torch) with SHARD_BUILD_DIR and PYTHONPATH=build/python; by hand:
    SHARD_BUILD_DIR=build PYTHONPATH=build/python /usr/bin/python3 -m pytest \\
        tests/python/test_torch_optim.py
"""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from optim_worker import OPTIMIZERS, Tied, build, groups, warmup  # noqa: E402
from test_torch import (BIN, WIDTHS, cluster, exported,  # noqa: E402,F401  (cluster: fixture)
                        max_relative_difference, wait_for)

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "optim_worker.py")
BATCH = 24  # the Cluster's job spec's global batch



def test_scalar_extras_come_back_with_the_same_bits_and_the_rest_goes_through_torch_save():
    # A step count as Adam keeps it, and every 0-d dtype a class might keep, with values whose
    # bits a careless text form would change.
    from shard.optim import dumps, loads
    scalars = {"step": torch.tensor(3.0), "third": torch.tensor(1 / 3, dtype=torch.float64),
               "big": torch.tensor(2**62 + 1), "nan": torch.tensor(float("nan")),
               "bf16": torch.tensor(-0.1, dtype=torch.bfloat16),
               "half": torch.tensor(65504.0, dtype=torch.float16), "flag": torch.tensor(True),
               "count": 7, "rate": 0.1, "on": False}
    saved = {"whole": scalars, "present": ["exp_avg", "exp_avg_sq"]}
    data = dumps(saved)
    assert not data.startswith(b"PK"), "scalars should not pay for torch.save's container"
    back = loads(data)
    assert back["present"] == ["exp_avg", "exp_avg_sq"]
    assert set(back["whole"]) == set(scalars)
    for name, value in scalars.items():
        got = back["whole"][name]
        if isinstance(value, torch.Tensor):
            assert got.dtype == value.dtype and got.dim() == 0, name
            assert got.view(-1).view(torch.uint8).tolist() == \
                value.view(-1).view(torch.uint8).tolist(), name  # the same bits, NaN included
        else:
            assert type(got) is type(value) and got == value, name
    # Anything else (a per-element tensor, a tuple) is torch.save's, and still comes back.
    for whole in ({"moment": torch.arange(4.0)}, {"betas": (0.9, 0.99)}):
        data = dumps({"whole": whole, "present": []})
        assert data.startswith(b"PK")
        back = loads(data)["whole"]
        assert list(back) == list(whole)
        for name, value in whole.items():
            assert (torch.equal(back[name], value) if isinstance(value, torch.Tensor)
                    else back[name] == value)

def config_of(cluster, optimizer, **extra):
    return dict(optimizer=optimizer, widths=WIDTHS, data=cluster.data, **extra)


def reference(config, steps, save=None, device="cpu"):
    """Plain torch in one process on the whole global batch of every step: the model and its
    optimizer after `steps` steps; with `save`, their state_dicts and the schedule's are written
    to that path."""
    torch.set_num_threads(1)
    model, inputs, targets = build(config)
    model.to(device)
    inputs, targets = inputs.to(device), targets.to(device)
    optimizer_class, settings, _ = OPTIMIZERS[config["optimizer"]]
    optimizer = optimizer_class(groups(model, config, by_name=False), **settings)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    for step in range(steps):
        idx = (torch.arange(step * BATCH, (step + 1) * BATCH) % len(inputs)).to(device)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(inputs[idx]), targets[idx]).backward()
        optimizer.step()
        schedule.step()
    if save is not None:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "schedule": schedule.state_dict()}, save)
    return model, optimizer


def parameters(model):
    return {name: p.detach().cpu() for name, p in model.named_parameters()}


def train(cluster, config, world, steps, mode, *coordinator_args, prefix="w", **job):
    """One job of `world` optim_worker.py processes; returns them once each exited 0."""
    cluster.start_coordinator(cluster.write_job(world=world, steps=steps, shardMode=mode,
                                                optimizer={"name": "torch"}, **job),
                              *coordinator_args, log_name=f"coordinator-{prefix}.log")
    workers = [cluster.start_worker(f"{prefix}{i}", script=WORKER,
                                    args=["--config", json.dumps(config)]) for i in range(world)]
    for worker in workers:
        assert cluster.wait(worker) == 0, cluster.log(worker)
    return workers


# Elementwise classes in range mode (1-D views of the owned ranges), the shape-aware one in
# param mode (whole parameters), each at two and three ranks.
CASES = [(name, mode, world) for name, mode in (("AdamW", "range"), ("RMSprop", "range"),
                                                ("Adagrad", "range"), ("Factored", "param"))
         for world in (2, 3)]


@pytest.mark.parametrize("name,mode,world", CASES, ids=[f"{n}-{m}-w{w}" for n, m, w in CASES])
def test_any_optimizer_class_equals_single_process_torch(cluster, name, mode, world):
    steps = 20
    config = config_of(cluster, name)
    train(cluster, config, world, steps, mode)
    model, _ = reference(config, steps)
    difference = max_relative_difference(exported(cluster), parameters(model))
    print(f"{name} in {mode} mode on {world} workers against one torch process: {difference:.3g}")
    assert difference <= 1e-5


@pytest.mark.parametrize("name,mode,world", [("AdamW", "range", 2), ("Factored", "param", 3)],
                         ids=["AdamW-range-w2", "Factored-param-w3"])
def test_the_scripts_class_at_zero_stage_3_equals_single_process_torch(cluster, name, mode,
                                                                       world):
    steps = 20
    config = config_of(cluster, name)
    train(cluster, config, world, steps, mode, zeroStage=3)
    model, _ = reference(config, steps)
    difference = max_relative_difference(exported(cluster), parameters(model))
    print(f"{name} in {mode} mode on {world} workers at stage 3 against one torch process: "
          f"{difference:.3g}")
    assert difference <= 1e-5


def test_a_shape_aware_class_is_refused_in_range_mode_naming_param_mode(cluster):
    cluster.start_coordinator(cluster.write_job(world=1, steps=3, optimizer={"name": "torch"}))
    worker = cluster.start_worker("w0", script=WORKER,
                                  args=["--config", json.dumps(config_of(cluster, "Factored"))])
    assert cluster.wait(worker) != 0
    log = cluster.log(worker)
    assert "cannot run in range mode" in log and '"shardMode": "param"' in log, log


def test_saved_on_three_restores_on_two_in_either_shard_mode(cluster):
    config = config_of(cluster, "AdamW")
    train(cluster, config, 3, 10, "range", every=10, prefix="three")
    assert cluster.wait(cluster.coordinator) == 0
    model, _ = reference(config, 20)
    for mode in ("range", "param"):
        train(cluster, config, 2, 20, mode, "--restore", "step-00000010-g1", out=mode,
              file=f"{mode}.json", every=10, prefix=f"two-{mode}")
        got = exported(cluster, mode)
        difference = max_relative_difference(got, parameters(model))
        print(f"saved on 3 in range mode, restored on 2 in {mode} mode: {difference:.3g}")
        assert difference <= 1e-4


# From memory: the shape-aware class in param mode (its factored moments travel as extras); from
# disk: AdamW in range mode. (Both train stably for 300 steps: with a chaotic optimizer, such as
# RMSprop at lr 0.01 here, splitting the batch differently alone moves the result by 0.15.)
RECOVERIES = [("memory", "Factored", "param"), ("disk", "AdamW", "range")]


@pytest.mark.parametrize("source,name,mode", RECOVERIES, ids=[r[0] for r in RECOVERIES])
def test_a_killed_worker_is_survived_and_training_ends_equal_to_torch(cluster, source, name, mode):
    steps = 300
    config = config_of(cluster, name)
    job = {"snapshot_every": 10} if source == "memory" else {"every": 10}
    cluster.start_coordinator(cluster.write_job(world=3, min_world=2, steps=steps, shardMode=mode,
                                                optimizer={"name": "torch"}, **job))
    workers = [cluster.start_worker(f"w{i}", script=WORKER, args=["--config", json.dumps(config)])
               for i in range(3)]

    def progressed():
        status = cluster.shardctl("status", "--json")
        if status.returncode != 0:
            return False
        progress = json.loads(status.stdout)["progress"]
        return (progress["last_snapshot_step"] if source == "memory"
                else progress["last_checkpoint_step"] or 0) >= 30

    wait_for(progressed, 60, f"a {source} restore point at step 30")
    workers[1].kill()
    for worker in (workers[0], workers[2]):
        assert cluster.wait(worker) == 0, cluster.log(worker)
    log = cluster.log(workers[0])
    restored = r"restored memory snapshot" if source == "memory" else r"restored checkpoint"
    assert re.search(restored + r" \S+ \(step \d+\)", log), log
    model, _ = reference(config, steps)
    difference = max_relative_difference(exported(cluster), parameters(model))
    print(f"{name} in {mode} mode, one of 3 workers killed, restored from {source} on 2: "
          f"against one torch process {difference:.3g}")
    assert difference <= 1e-4


@pytest.mark.parametrize("stage", [2, 3])
def test_resize_and_drain_move_the_optimizers_state_and_training_ends_equal_to_torch(cluster,
                                                                                    stage):
    # Three ranks, resized to two by the operator, then one of them drained: the optimizer's
    # state moves through memory snapshots each time. The workers hold at a gate (optim_worker.py)
    # until each request is in, so that neither lands after the last step however slow the
    # machine.
    steps = 300
    resized_gate = {"world": 3, "step": 20, "file": os.path.join(cluster.tmp, "resize-asked")}
    drained_gate = {"world": 2, "step": 80, "file": os.path.join(cluster.tmp, "drain-asked")}
    config = config_of(cluster, "AdamW", gates=[resized_gate, drained_gate])
    cluster.start_coordinator(cluster.write_job(world=3, min_world=1, steps=steps,
                                                snapshot_every=10, optimizer={"name": "torch"},
                                                zeroStage=stage))
    workers = [cluster.start_worker(f"w{i}", script=WORKER, args=["--config", json.dumps(config)])
               for i in range(3)]

    def ranked_at(world, step):
        """The ids of the ranked workers once `world` of them run at `step` or past it."""
        answer = cluster.shardctl("status", "--json")
        if answer.returncode != 0:
            return None
        now = json.loads(answer.stdout)
        ranked = [w["id"] for w in now["workers"] if w["rank"] >= 0]
        at = now["world_size"] == world and (now["progress"]["step"] or 0) >= step
        return ranked if at and len(ranked) == world else None

    def open_gate(gate):
        with open(gate["file"], "w"):
            pass

    wait_for(lambda: ranked_at(3, 20), 60, "step 20 on three ranks")
    resized = cluster.shardctl("resize", "--world-size", "2", "--no-wait")
    assert resized.returncode == 0, resized.stdout + resized.stderr
    open_gate(resized_gate)
    ranked = wait_for(lambda: ranked_at(2, 80), 60, "step 80 on two ranks")
    drained = cluster.shardctl("drain", ranked[-1], "--no-wait")
    assert drained.returncode == 0, drained.stdout + drained.stderr
    open_gate(drained_gate)
    for worker in workers:
        assert cluster.wait(worker) == 0, cluster.log(worker)
        assert "at the gate of step 20 in a world of 3" in cluster.log(worker)
    assert sum("at the gate of step 80 in a world of 2" in cluster.log(w) for w in workers) == 2
    events = cluster.log("coordinator.log").lower()
    assert "resiz" in events and "drain" in events, events
    model, _ = reference(config, steps)
    difference = max_relative_difference(exported(cluster), parameters(model))
    print(f"AdamW at stage {stage}, resized 3 -> 2 and drained to 1 while training: against one "
          f"torch process {difference:.3g}")
    assert difference <= 1e-4


def consolidated_against_torch(got, model, optimizer):
    """The largest relative difference of a consolidated state dict from the reference's model
    and optimizer state_dicts, which must have the same keys, groups and state entries."""
    want = optimizer.state_dict()
    assert got["optimizer"]["param_groups"] == want["param_groups"], (
        got["optimizer"]["param_groups"], want["param_groups"])
    assert sorted(got["optimizer"]["state"]) == sorted(want["state"])
    differences = [max_relative_difference(got["model"], model.state_dict())]
    for index, state in want["state"].items():
        mine = got["optimizer"]["state"][index]
        assert sorted(mine) == sorted(state), (sorted(mine), sorted(state))
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                differences.append(max_relative_difference({name: mine[name].float()},
                                                           {name: value.float()}))
            else:
                assert mine[name] == value, (name, mine[name], value)
    return max(differences)


CONSOLIDATIONS = [("AdamW", "range"), ("Factored", "param")]


@pytest.mark.parametrize("name,mode", CONSOLIDATIONS, ids=[f"{n}-{m}" for n, m in CONSOLIDATIONS])
def test_consolidated_state_dict_equals_torch_mid_training(cluster, name, mode):
    consolidated = os.path.join(cluster.tmp, "consolidated.pt")
    config = config_of(cluster, name, consolidate_after=10, consolidated=consolidated)
    workers = train(cluster, config, 3, 12, mode)
    model, optimizer = reference(config, 10)
    difference = consolidated_against_torch(torch.load(consolidated), model, optimizer)
    print(f"{name} in {mode} mode, consolidated at step 10 of 3 workers, against torch's "
          f"state_dicts: {difference:.3g}")
    assert difference <= 1e-5
    log = "".join(cluster.log(worker) for worker in workers)
    assert "opt.state_dict() equals engine.consolidated_state_dict()" in log, log


@pytest.mark.parametrize("name,mode", CONSOLIDATIONS, ids=[f"{n}-{m}" for n, m in CONSOLIDATIONS])
def test_a_plain_torch_optimizers_state_dict_loads_and_training_goes_on_equal(cluster, name,
                                                                             mode):
    # Ten steps of plain torch, saved with state_dict(); Shard loads them (model, optimizer,
    # schedule) on 3 ranks and trains ten more: equal to plain torch's twenty.
    saved = os.path.join(cluster.tmp, "plain.pt")
    config = config_of(cluster, name, resume=saved, offset=10)
    reference(config, 10, save=saved)
    train(cluster, config, 3, 10, mode)
    model, _ = reference(config, 20)
    difference = max_relative_difference(exported(cluster), parameters(model))
    print(f"{name} in {mode} mode: 10 steps of plain torch loaded, 10 more on 3 workers, "
          f"against 20 of plain torch: {difference:.3g}")
    assert difference <= 1e-5


def test_consolidation_memory_is_bounded_by_the_largest_parameter(cluster):
    # A model large enough for its state to dwarf the allocator's noise: 3.1 M parameters, the
    # largest 2 M (8 MB). SGD with momentum: Adam's normalised steps would turn the rounding of
    # three ranks' gradients into differences of 2e-4 on this model after 10 steps (plain torch
    # alone does that when it splits the batch in three).
    widths = [512, 2048, 1024, 8]
    data = os.path.join(cluster.tmp, "wide.safetensors")
    generated = subprocess.run(
        [os.path.join(BIN, "shardctl"), "data", "generate", "--widths", ",".join(map(str, widths)),
         "--samples", "96", "--seed", "3", "--out", data],
        capture_output=True, text=True, timeout=60)
    assert generated.returncode == 0, generated.stdout + generated.stderr
    consolidated = os.path.join(cluster.tmp, "consolidated.pt")
    config = dict(optimizer="SGD", widths=widths, data=data, consolidate_after=10,
                  consolidated=consolidated)
    workers = train(cluster, config, 3, 12, "range")
    model, optimizer = reference(config, 10)
    state = torch.load(consolidated)
    difference = consolidated_against_torch(state, model, optimizer)
    print(f"SGD on a 3.1 M-parameter MLP, consolidated at step 10 of 3 workers: {difference:.3g}")
    assert difference <= 1e-5
    # Each rank's memory grew by at most two of the largest parameter (the range in flight and
    # its copy) beyond what it keeps: rank 0 keeps the whole state, the others nothing.
    kept = sum(v.numel() * v.element_size() for v in state["model"].values()) + sum(
        v.numel() * v.element_size() for s in state["optimizer"]["state"].values()
        for v in s.values() if isinstance(v, torch.Tensor))
    slack = 8 << 20
    for worker in workers:
        (line,) = re.findall(r"consolidation memory (\{.*\})", cluster.log(worker))
        memory = json.loads(line)
        bound = 2 * memory["largest_param_bytes"] + slack + (kept if memory["rank"] == 0 else 0)
        print(f"rank {memory['rank']}: memory grew {memory['grown'] / 2**20:.1f} MiB while "
              f"consolidating (bound {bound / 2**20:.1f} MiB; the whole state is "
              f"{kept / 2**20:.1f} MiB)")
        assert memory["grown"] <= bound, memory


def test_tied_weights_are_exported_and_consolidated_under_every_state_dict_name(cluster):
    config = dict(optimizer="AdamW", tied=True, consolidate_after=4,
                  consolidated=os.path.join(cluster.tmp, "consolidated.pt"))
    train(cluster, config, 2, 6, "range")
    fresh = Tied(16, 8)
    got = exported(cluster)
    assert sorted(got) == sorted(fresh.state_dict()), sorted(got)
    fresh.load_state_dict(got, strict=True)
    assert torch.equal(fresh.head.weight, fresh.embedding.weight)
    state = torch.load(config["consolidated"])
    plain = Tied(16, 8)
    plain.load_state_dict(state["model"], strict=True)
    optimizer_class, settings, _ = OPTIMIZERS["AdamW"]
    optimizer_class(groups(plain, config, by_name=False), **settings).load_state_dict(
        state["optimizer"])


def test_the_job_spec_and_the_script_must_agree_on_the_optimizer(cluster):
    cluster.start_coordinator(cluster.write_job(world=1, steps=3))  # the built-in adam
    worker = cluster.start_worker("w0", script=WORKER,
                                  args=["--config", json.dumps(config_of(cluster, "AdamW"))])
    assert cluster.wait(worker) != 0
    assert 'set "optimizer": {"name": "torch"} in the job spec' in cluster.log(worker)


def test_ranks_that_bring_different_optimizers_are_refused(cluster):
    cluster.start_coordinator(cluster.write_job(world=2, steps=5, optimizer={"name": "torch"}))
    workers = [cluster.start_worker(f"w{i}", script=WORKER,
                                    args=["--config", json.dumps(config_of(cluster, name))])
               for i, name in enumerate(("AdamW", "Adagrad"))]
    for worker in workers:
        assert cluster.wait(worker) != 0
        assert "the ranks run different optimizers" in cluster.log(worker), cluster.log(worker)
