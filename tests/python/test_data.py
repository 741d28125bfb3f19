"""shard.data.ElasticSampler: global batches that do not depend on the world size, a new order
every epoch, and a start at the step training goes on from.

First with a fake job (the sampler reads only rank, world_size, next_step and spec), then as
DataLoader(batch_sampler=..., num_workers=2) in torch workers of a real coordinator: at three
ranks, and with the world resized from three to two mid-epoch.

Run by ctest (python_torch) with SHARD_BUILD_DIR and PYTHONPATH=build/python; by hand:
    SHARD_BUILD_DIR=build PYTHONPATH=build/python /usr/bin/python3 -m pytest \
        tests/python/test_data.py
"""

import collections
import json
import os
import sys

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import shard.torch
from shard.data import ElasticSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_torch import DEADLINE, Cluster, wait_for  # noqa: E402  (the processes' harness)


class FakeJob:
    """What the sampler reads of a shard.torch Job. The spec's int64 fields are strings, as in
    the JSON libshard hands out."""

    def __init__(self, rank, world_size, batch, steps, next_step=None):
        self.rank, self.world_size, self.next_step = rank, world_size, next_step
        self.spec = {"global_batch": str(batch), "steps": str(steps)}


def global_batches(n, batch, steps, world, **options):
    """Every step's global batch as the ranks of a world of `world` read it: the concatenation
    of their lists, in rank order, and each rank's lists."""
    per_rank = [list(ElasticSampler(n, FakeJob(r, world, batch, steps), **options))
                for r in range(world)]
    for lists in per_rank:
        assert len(lists) == steps and all(len(share) == batch // world for share in lists)
    return [sum((per_rank[r][s] for r in range(world)), []) for s in range(steps)], per_rank


def epochs_of(batches, n, batch):
    """The samples at each epoch's positions: {epoch: [sample, ...]}."""
    epochs = collections.defaultdict(list)
    for step, samples in enumerate(batches):
        for i, sample in enumerate(samples):
            epochs[(step * batch + i) // n].append(sample)
    return epochs


@pytest.mark.parametrize("n,batch", [(50, 12), (66, 12), (5, 12), (7, 6)],
                         ids=["straddling", "aligned-every-11-steps", "batch-over-3-epochs",
                              "epoch-of-7"])
def test_the_global_batch_is_the_same_at_every_world_size_and_each_epoch_is_a_permutation(
        n, batch):
    steps = 30
    one, _ = global_batches(n, batch, steps, 1)
    for world in (2, 3):
        if batch % world == 0:
            assert global_batches(n, batch, steps, world)[0] == one, world
    epochs = epochs_of(one, n, batch)
    complete = steps * batch // n
    for epoch in range(complete):
        assert sorted(epochs[epoch]) == list(range(n)), epoch  # every sample exactly once
    if complete in epochs:  # the run's last, partial epoch: no sample twice
        assert len(set(epochs[complete])) == len(epochs[complete])
    if n >= 10:  # 10! orders: a repeat among 30 epochs would be the sampler's fault, not chance
        orders = [tuple(epochs[e]) for e in range(complete)]
        assert len(set(orders)) == len(orders), "an epoch repeated another's order"


def test_the_order_follows_the_seed_and_not_the_instance():
    first, _ = global_batches(50, 12, 25, 2, seed=3)
    assert global_batches(50, 12, 25, 2, seed=3)[0] == first
    assert global_batches(50, 12, 25, 2, seed=4)[0] != first
    # Epoch e's order is torch.randperm(N) seeded with seed + e: documented, so a program
    # without the sampler (an evaluation, a data audit) can rebuild it.
    expected = torch.randperm(50, generator=torch.Generator().manual_seed(3 + 1))
    assert epochs_of(first, 50, 12)[1] == expected.tolist()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_without_shuffling_the_indices_are_job_batch_indices(world):
    for rank in range(world):
        job = FakeJob(rank, world, 12, 25)
        sampler = ElasticSampler(50, job, shuffle=False)
        lists = list(sampler)
        for step in range(25):
            # The Job's own method, run on the fake job (it reads the same three attributes).
            want = shard.torch.Job.batch_indices(job, step, 50)
            assert torch.equal(sampler.indices(step), want)
            assert lists[step] == want.tolist()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_sampler_that_starts_at_next_step_reads_on_from_exactly_there(world):
    for start in (0, 1, 4, 13, 24, 25):
        for rank in range(world):
            full = list(ElasticSampler(50, FakeJob(rank, world, 12, 25)))
            resumed = ElasticSampler(50, FakeJob(rank, world, 12, 25, next_step=start))
            assert len(resumed) == 25 - start
            assert list(resumed) == full[start:], (start, rank)
            for step in range(start, 25):
                assert resumed.indices(step).tolist() == full[step]


def test_a_restart_at_another_world_size_mid_epoch_sees_every_sample_once():
    # Steps 0-6 on three ranks, then 7-24 on two: the global batches are those of one rank.
    one, _ = global_batches(50, 12, 25, 1)
    before = [ElasticSampler(50, FakeJob(r, 3, 12, 7)) for r in range(3)]
    after = [ElasticSampler(50, FakeJob(r, 2, 12, 25, next_step=7)) for r in range(2)]
    lists = [list(s) for s in before]
    got = [sum((lists[r][s] for r in range(3)), []) for s in range(7)]
    lists = [list(s) for s in after]
    got += [sum((lists[r][s] for r in range(2)), []) for s in range(18)]
    assert got == one
    epochs = epochs_of(got, 50, 12)
    for epoch in range(6):
        assert sorted(epochs[epoch]) == list(range(50))


def test_epoch_of_a_step_is_the_epoch_of_its_first_sample():
    sampler = ElasticSampler(50, FakeJob(0, 1, 12, 25))
    assert [sampler.epoch(s) for s in (0, 4, 5, 8, 9, 24)] == [0, 0, 1, 1, 2, 5]


def test_a_dataloader_with_workers_yields_the_sampler_s_batches():
    class Samples(Dataset):
        def __len__(self):
            return 50

        def __getitem__(self, i):
            return torch.tensor([float(i)]), i

    sampler = ElasticSampler(50, FakeJob(1, 2, 12, 25, next_step=3))
    loader = DataLoader(Samples(), batch_sampler=sampler, num_workers=2)
    assert len(loader) == 22
    batches = [(x.squeeze(1).long().tolist(), y.tolist()) for x, y in loader]
    assert [y for _, y in batches] == list(sampler)
    assert all(x == y for x, y in batches)


def test_a_persistent_loader_made_anew_follows_the_new_generation():
    # job.steps(loader) calls iter(loader) at every generation; with persistent_workers the
    # DataLoader keeps its worker processes and asks the sampler for a new iterator.
    class Samples(Dataset):
        def __len__(self):
            return 50

        def __getitem__(self, i):
            return i

    job = FakeJob(0, 3, 12, 25, next_step=0)
    sampler = ElasticSampler(50, job)
    loader = DataLoader(Samples(), batch_sampler=sampler, num_workers=2, persistent_workers=True)
    batches = iter(loader)
    assert [next(batches).tolist() for _ in range(3)] == list(sampler)[:3]
    del batches  # the generation ends with steps 3.. prefetched
    job.rank, job.world_size, job.next_step = 1, 2, 3
    assert [b.tolist() for b in loader] == [sampler.indices(s).tolist() for s in range(3, 25)]


def test_mistakes_are_clear_errors():
    with pytest.raises(ValueError, match="at least one sample"):
        ElasticSampler(0, FakeJob(0, 1, 12, 25))
    with pytest.raises(TypeError, match="dataset_len must be an integer"):
        ElasticSampler(50.0, FakeJob(0, 1, 12, 25))
    sampler = ElasticSampler(50, FakeJob(0, 5, 12, 25))
    with pytest.raises(ValueError, match="global batch 12 is not a positive multiple of the "
                                         "world size 5"):
        iter(sampler)
    with pytest.raises(ValueError, match="not a positive multiple"):
        sampler.indices(0)


# Processes: 50 samples, a global batch of 12 and 25 steps are 6 epochs, and no step boundary
# but the first and the last is an epoch boundary: wherever the world changes, it is mid-epoch,
# and epochs end inside steps 4, 8, 12, 16 and 20 (batches straddling two epochs).
SAMPLES, BATCH, STEPS, SEED = 50, 12, 25, 7

SCRIPT = '''
import json
import os
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset

import shard.torch as shard
from shard.data import ElasticSampler

torch.set_num_threads(1)
loop, gate_step, gate = sys.argv[1], int(sys.argv[2]), sys.argv[3]


class Samples(Dataset):
    """Sample i: features made from i, and i itself as the target, so a batch says which
    samples it holds."""

    def __len__(self):
        return %(samples)d

    def __getitem__(self, i):
        return torch.tensor([i / %(samples)d, (i %% 7) / 7.0, 1.0]), i


torch.manual_seed(0)
model = torch.nn.Linear(3, 1)
job = shard.join()
engine = job.wrap(model)
loader = DataLoader(Samples(), num_workers=2,
                    batch_sampler=ElasticSampler(len(Samples()), job, seed=%(seed)d))
pairs = zip(job.steps(), loader) if loop == "zip" else job.steps(loader)
for step, (x, y) in pairs:
    if step == gate_step:  # held here until the test has asked for a resize
        print("at the gate", flush=True)
        deadline = time.monotonic() + 60
        while not os.path.exists(gate):
            if time.monotonic() > deadline:
                sys.exit("the gate did not open within 60 s")
            time.sleep(0.01)
    print(json.dumps({"generation": job.generation, "rank": job.rank, "world": job.world_size,
                      "step": step, "indices": y.tolist()}), flush=True)
    loss = model(x).pow(2).mean()
    loss.backward()
    engine.step()
    job.report(loss=loss.item())
job.finish()
''' % {"samples": SAMPLES, "seed": SEED}


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(str(tmp_path))
    with c.processes:
        yield c


def start_training(cluster, loop, gate_step=-1, **job):
    script = os.path.join(cluster.tmp, "train.py")
    with open(script, "w") as f:
        f.write(SCRIPT)
    gate = os.path.join(cluster.tmp, "gate")
    cluster.start_coordinator(cluster.write_job(world=3, steps=STEPS, globalBatch=BATCH, **job))
    workers = [cluster.start_worker(f"w{i}", script=script, args=[loop, str(gate_step), gate])
               for i in range(3)]
    return workers, gate


def last_runs(cluster, workers):
    """Each step's lines from the last generation that ran it (a step in flight when its
    generation ended is run again by the next), in rank order."""
    by_step = collections.defaultdict(list)
    for worker in workers:
        for line in cluster.log(worker).splitlines():
            if line.startswith('{"generation"'):
                record = json.loads(line)
                by_step[record["step"]].append(record)
    last = {}
    for step, records in by_step.items():
        generation = max(r["generation"] for r in records)
        last[step] = sorted((r for r in records if r["generation"] == generation),
                            key=lambda r: r["rank"])
    return last, by_step


def check_every_sample_once_per_epoch(last):
    """The ranks of each step's last run are 0..W-1 and together read the global batch one rank
    would; counted per epoch, every sample was trained on exactly once. Returns each step's W."""
    assert sorted(last) == list(range(STEPS)), sorted(last)
    expected, _ = global_batches(SAMPLES, BATCH, STEPS, 1, seed=SEED)
    worlds = []
    counts = collections.defaultdict(collections.Counter)
    for step in range(STEPS):
        records = last[step]
        world = records[0]["world"]
        assert [r["rank"] for r in records] == list(range(world)), (step, records)
        assert all(r["world"] == world and len(r["indices"]) == BATCH // world for r in records)
        samples = sum((r["indices"] for r in records), [])
        assert samples == expected[step], (step, samples, expected[step])
        for i, sample in enumerate(samples):
            counts[(step * BATCH + i) // SAMPLES][sample] += 1
        worlds.append(world)
    assert sorted(counts) == list(range(STEPS * BATCH // SAMPLES))
    for epoch, seen in counts.items():
        assert sorted(seen) == list(range(SAMPLES)) and set(seen.values()) == {1}, (epoch, seen)
    return worlds


def test_three_ranks_see_every_sample_once_per_epoch_through_a_zip_loop(cluster):
    # A steady world from step 0: the plain zip(job.steps(), loader) loop is right.
    workers, _ = start_training(cluster, "zip")
    for worker in workers:
        assert cluster.wait(worker) == 0, cluster.log(worker)
    last, by_step = last_runs(cluster, workers)
    assert all(len(records) == 3 for records in by_step.values())  # one generation, no re-run
    assert check_every_sample_once_per_epoch(last) == [3] * STEPS


def test_resized_from_three_to_two_mid_epoch_every_sample_is_seen_once(cluster):
    # Every rank holds at step 6 (positions 72-83, inside epoch 1) until the coordinator has
    # ordered the resize's pause, so that it lands mid-run: at the step boundary after step 6 or
    # soon after. job.steps(loader) then restarts the loader on the new world's rank and size.
    gate_step = 6
    workers, gate = start_training(cluster, "steps", gate_step=gate_step, min_world=2,
                                   snapshot_every=5)
    wait_for(lambda: all("at the gate" in cluster.log(w) for w in workers), DEADLINE,
             f"every rank at step {gate_step}")
    resized = cluster.shardctl("resize", "--world-size", "2", "--no-wait")
    assert resized.returncode == 0, resized.stdout + resized.stderr

    def pause_ordered():
        status = cluster.shardctl("status", "--json")
        return status.returncode == 0 and json.loads(status.stdout)["transition"] != ""

    wait_for(pause_ordered, 30, "the coordinator to order the resize's pause")
    open(gate, "w").close()
    for worker in workers:
        assert cluster.wait(worker) == 0, cluster.log(worker)
    assert cluster.wait(cluster.coordinator) == 0, cluster.log("coordinator.log")
    assert "resize to 2" in cluster.log("coordinator.log"), cluster.log("coordinator.log")

    last, by_step = last_runs(cluster, workers)
    worlds = check_every_sample_once_per_epoch(last)
    first_of_two = worlds.index(2)
    assert worlds == [3] * first_of_two + [2] * (STEPS - first_of_two), worlds
    assert gate_step < first_of_two < STEPS
    assert first_of_two * BATCH % SAMPLES != 0  # mid-epoch
    rerun = sorted(s for s, records in by_step.items() if len(records) > len(last[s]))
    print(f"resized 3 -> 2 at step {first_of_two} (position {first_of_two * BATCH}, epoch "
          f"{first_of_two * BATCH // SAMPLES}); steps run again after the resize: {rerun}")
