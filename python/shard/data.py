"""Data loading for shard.torch: a batch sampler whose global batches do not depend on the world
size, that reshuffles every epoch, and that resumes at the step training goes on from.

    from torch.utils.data import DataLoader
    from shard.data import ElasticSampler        # also shard.torch.data.ElasticSampler

    loader = DataLoader(dataset, batch_sampler=ElasticSampler(len(dataset), job), num_workers=2)
    for step, (x, y) in job.steps(loader):       # the loader restarts with every generation
        loss = loss_fn(model(x), y)
        loss.backward()
        engine.step()

Why not torch's DistributedSampler: a DataLoader over it starts at the first batch of the epoch
that set_epoch named, as it has no start position, so a run restored mid-epoch trains that
epoch's first batches again (samples seen twice) unless the loop fetches and throws away batches
until it catches up, loading their data for nothing. And its epochs depend on the world size: it
pads each epoch to a multiple of W with repeated samples and ends it with a short (or dropped)
batch, so how many steps an epoch takes, which samples repeat and where the next epoch begins
all change when the world re-forms at another size: a step number no longer says where in the
data training is.

ElasticSampler numbers the positions of the whole run instead: global batch `step` of size B
(the job's global_batch) covers the positions [step*B, (step+1)*B); position k lies in epoch
k // N at index k % N of that epoch's order (torch.randperm(N) seeded with seed + epoch, or
0..N-1 without shuffling), and rank r of W takes the r-th contiguous B/W positions of the step.
Epochs are not padded (a batch that crosses an epoch's end takes the next epoch's first
samples), every step's global batch is a function of the step alone, each epoch visits every
sample exactly once whatever world sizes trained it, and a sampler started at any step reads on
from exactly there: no set_epoch, nothing skipped.
"""

import collections
import operator

import torch
from torch.utils.data import Sampler

__all__ = ["ElasticSampler"]


class ElasticSampler(Sampler):
    """A batch sampler (DataLoader's `batch_sampler=`) that yields this rank's sample indices of
    every step still to run: one list per global step, from job.next_step to the job's last.

    `dataset_len` is N, the number of samples; `job` the shard.torch Job (read: rank, world_size,
    next_step, spec["global_batch"], spec["steps"]). With `shuffle`, epoch e's order is
    torch.randperm(N) from a generator seeded with `seed` + e, the same on every rank (all ranks
    must run the same torch: the permutation is torch's); without it, the indices are those of
    job.batch_indices(step, N).

    The iterator starts at job.next_step as it is when iter() is called: job.steps(loader) makes a
    new iterator at the start of every generation, so after a restore or a re-formation the
    batches start at the step training goes on from, on the new world's rank and size. A plain
    `zip(job.steps(), loader)` makes its iterator before any generation has begun (next_step is
    None, so it starts at step 0) and keeps it across re-formations; it is right only for a job
    that starts from step 0 and keeps its world (no restore, no death, no resize).

    The indices are computed in the process that iterates the loader (the DataLoader's workers
    receive the lists), vectorized, with the permutations of the last two epochs used cached: a
    step's batch may straddle two epochs.
    """

    def __init__(self, dataset_len, job, shuffle=True, seed=0):
        try:
            dataset_len = operator.index(dataset_len)
        except TypeError:
            raise TypeError(f"ElasticSampler: dataset_len must be an integer (len(dataset)), not "
                            f"{type(dataset_len).__name__}") from None
        if dataset_len < 1:
            raise ValueError(f"ElasticSampler: dataset_len is {dataset_len}; a data set to sample "
                             "from needs at least one sample")
        self.dataset_len = dataset_len
        self.job = job
        self.shuffle = bool(shuffle)
        self.seed = operator.index(seed)
        self._orders = collections.OrderedDict()  # epoch -> its permutation, the last two used

    def __iter__(self):
        """This rank's index lists of steps job.next_step (0 before any generation) up to the
        job's last. The world and the start are read now, once: a running iterator keeps the
        generation it was made in."""
        first, last = self._range()
        batch, share = self._shares()
        return self._batches(first, last, self.job.rank, batch, share)

    def _batches(self, first, last, rank, batch, share):
        for step in range(first, last):
            begin = step * batch + rank * share
            yield self._samples(begin, begin + share).tolist()

    def __len__(self):
        """The number of steps still to run from job.next_step (what an iterator made now
        yields)."""
        first, last = self._range()
        return last - first

    def indices(self, step):
        """This rank's sample indices of global batch `step` (an int64 tensor of B/W indices)."""
        batch, share = self._shares()
        begin = operator.index(step) * batch + self.job.rank * share
        return self._samples(begin, begin + share)

    def epoch(self, step):
        """The epoch global batch `step` starts in (a batch that straddles an epoch's end belongs
        to the epoch of its first sample): for an epoch-wise schedule or evaluation."""
        return operator.index(step) * self._global_batch() // self.dataset_len

    def _global_batch(self):
        return int(self.job.spec["global_batch"])  # int64 fields come as JSON strings

    def _range(self):
        steps = int(self.job.spec["steps"])
        start = self.job.next_step
        start = 0 if start is None else min(int(start), steps)
        return start, steps

    def _shares(self):
        """(B, B/W): the job's global batch and this rank's share of it."""
        batch, world = self._global_batch(), self.job.world_size
        if batch < 1 or batch % world:
            # The job spec's validation refuses such a job; a job object that is not Shard's may
            # not have been through it.
            raise ValueError(f"ElasticSampler: the global batch {batch} is not a positive "
                             f"multiple of the world size {world}: every rank takes an equal "
                             "share of each global batch")
        return batch, batch // world

    def _samples(self, begin, end):
        """The samples at global positions [begin, end)."""
        n = self.dataset_len
        if not self.shuffle:
            return torch.arange(begin, end, dtype=torch.int64) % n
        parts = []
        position = begin
        while position < end:  # one slice per epoch the range touches
            epoch, offset = divmod(position, n)
            take = min(end - position, n - offset)
            parts.append(self._order(epoch)[offset:offset + take])
            position += take
        if len(parts) == 1:
            return parts[0].clone()  # callers may write to what they get; the cache must stay
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def _order(self, epoch):
        """Epoch `epoch`'s permutation of range(N), the same in every process."""
        order = self._orders.get(epoch)
        if order is None:
            generator = torch.Generator()
            generator.manual_seed(self.seed + epoch)
            order = torch.randperm(self.dataset_len, generator=generator)
            self._orders[epoch] = order
            while len(self._orders) > 2:
                self._orders.popitem(last=False)
        else:
            self._orders.move_to_end(epoch)
        return order
