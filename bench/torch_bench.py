"""shard.torch against PyTorch's own data parallelism, measured in one run on this machine.

For each model (the medium MLP 512,1024,1024,1024,64 with Adam at global batch 256; the tiny MLP
64,64,64,10, 8,970 parameters, with Adam at global batch 32, where the fixed cost per step is
nearly all there is; the example transformer at its default size with AdamW, a no-decay group
and gradient clipping at global batch 32) it runs nine configurations, each as real processes
with one compute thread each (OMP_NUM_THREADS=1, OPENBLAS_NUM_THREADS=1,
torch.set_num_threads(1)):

  plain       plain torch, one process, torch.optim.Adam/AdamW(foreach=False), the whole batch
  shard1      shard.torch at W=1: shard-coordinator + one worker process, ZeRO-2
  ddp2        torch DDP (gloo, a file store) + ZeroRedundancyOptimizer at W=2, half batch each,
              torch's defaults (bucket_cap_mb 25, parameters_as_bucket_view=False)
  ddp2bv      the same with ZeroRedundancyOptimizer(parameters_as_bucket_view=True): one
              parameter broadcast per rank instead of one per parameter
  shard2      shard.torch at W=2, ZeRO-2 (bucket cap 25 MiB, the job spec's default), half
              batch each, SHARD_TRANSPORT=auto: shared memory, every rank being on this host
  shard2tcp   the same with SHARD_TRANSPORT=tcp: Gloo's TCP over loopback, as across hosts
  shard2z3    shard2 at ZeRO-3: each rank keeps half the parameters and gathers a unit's
              (wrap's default policy) around its forward and again for its backward
  plainopt    plain torch, one process, with the optimizer as a script that brings its own
              writes it: the torch.optim class (Adam/AdamW), its settings and foreach=False, and
              for the transformer the no-decay group by name pattern (Shard's rule: a pattern
              takes the parameters no earlier group took)
  shard1opt   shard.torch at W=1 with that same class, settings and groups as the script's own
              optimizer: the job spec's optimizer is {"name": "torch"}, the loop makes
              `opt = engine.optimizer(cls, groups, **settings)` and calls `opt.step()` (Shard's
              whole step: reduce, clip, the class's update on the rank's shard, gather)
  worker1     (the MLPs only) shard-worker's built-in MLP of the same widths and data, W=1: its
              own "steps/s over steps 2-N" and step/fwd+bwd from its log (no per-step split)
  worker2     the same at W=2, ZeRO-2, auto transport, half batch each

and, only when --configs names them:

  shard4      shard.torch at W=4, ZeRO-2, auto transport, a quarter batch each: on a machine
              with fewer than 4 cores the ranks take turns on them (oversubscribed)
  worker4     shard-worker's built-in MLP at W=4, ZeRO-2, likewise

Every worker is this file run with `worker --mode ...`: it builds the model from
examples/torch/, trains `--warmup` steps, then times `--steps` steps on rank 0's wall clock (from
the top of step K to the top of step K+N, so the step boundary of every timed step is inside)
and writes steps/s and the per-step split (forward+backward, optimizer or engine step, the rest).
The driver repeats each configuration `--repeats` times (configurations interleaved within a
repeat so slow drift of the machine's load hits all of them) and prints the median and range,
the transport each configuration's ranks exchanged data over (shard.torch's as its worker log
names it), and:

  step/fwd+bwd   the median step time over the median forward+backward time in it, rank 0's:
                 how much a step costs beyond the rank's own compute (target <= 1.1 for every
                 shard.torch and shard-worker configuration of the medium MLP and the
                 transformer but shard2tcp, which shows TCP beside the shared memory a host's
                 ranks use; shard-worker's is its own summary's mean step over mean
                 forward+backward)
  ratios         shard2/ddp2 (target >= 1.2), shard1/plain (target >= 0.95; the tiny MLP's
                 >= 1.0), shard1opt/plainopt (target >= 0.91: the script's class through
                 shard.torch within 10% of the same class in plain torch), PASS or MISS; beside
                 them shard2/ddp2bv (the same 1.2, against the better-tuned torch), shard2z3
                 against shard2 (target >= 0.85) and ddp2 (>= 1.2), and shard2/shard2tcp (what
                 shared memory gains over TCP, no target); for the built-in MLP worker2/ddp2
                 (target >= 1.5 where plain torch's forward+backward of the whole batch takes
                 under 40 ms, >= 1.2 on slower CPUs; no target for the tiny MLP) and
                 worker2/worker1 (target >= 1.3)

Rank 0's losses of the first steps of each pair are compared too: both sides train the same
samples with the same updates, so they agree to float32 rounding (a warning says when they do
not). The table's header names the CPU, the load average before and after the run, and warns
when other work was running.

    scripts/bench-torch.sh [--steps N] [--warmup K] [--repeats R] [--models mlp,tiny,transformer]
                           [--configs KEY,...] [--device cpu|cuda:N] [--bf16] [--json]
                           [--timeout S] [--keep]

--configs runs only the configurations named (the keys above; default: all of the device's but
shard4), and reports the ratios whose two sides ran: `--configs plainopt,shard1opt` measures the
script's own optimizer path alone, `--configs shard2,shard2tcp,shard4` the transports and W=4.

With --device cuda:N (one GPU) the configurations are those one GPU can compare:

  plain       plain torch on the GPU, torch.optim.Adam/AdamW(fused=True), the whole batch
  shard1      shard.torch W=1 on the GPU (NCCL), ZeRO-2
  worker1     (the MLPs only) shard-worker's built-in MLP of the same widths on the GPU, its
              own "steps/s over steps 2-N" (it has no per-step split)
  fsdp1       (torch 2.x) torch FSDP2, fully_shard on each transformer block and on the model,
              W=1 over NCCL, the fused optimizer as plain's
  shard1z3    shard.torch W=1 on the GPU, ZeRO-3 (wrap's default units)

and --bf16 runs the forward and backward passes under torch.autocast in bf16 (shard-worker:
the job's precision bf16); the targets are shard1/plain and worker1/plain >= 0.95, and
shard1z3/fsdp1 is reported beside them (no target: the same sharding, world of one). The
models there default to mlp,transformer, and step/fwd+bwd is left out (the split times kernel
launches, not the GPU's work).

Everything it starts listens on 127.0.0.1 (the coordinator on a free port it reports in a port
file; DDP rendezvous through a file store), is bounded by --timeout seconds per run and is
killed by pid when the run ends or the driver exits.
"""

import argparse
import atexit
import datetime
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples", "torch")
BUILD = os.path.abspath(os.environ.get("SHARD_BUILD_DIR", os.path.join(ROOT, "build")))
BIN = os.path.join(BUILD, "bin")
BENCH = os.path.abspath(__file__)  # every worker process runs this file
# The process harness shared with tests/ and scripts/ (tests/support is no package: its
# directory goes on the import path, found from this file so that the bench runs from anywhere).
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))
from shard_processes import ONE_THREAD, Processes, ProcessError, wait_all  # noqa: E402

# A model with "widths" is examples/torch/mlp.py's Mlp of those widths, trained on a
# `shardctl data generate` file whose labels come from a teacher MLP of "teacher" widths; the
# others are built in worker_main by name. "targets" overrides a ratio's target for the model.
MODELS = {
    "mlp": {
        "title": "medium MLP 512,1024,1024,1024,64, global batch 256, Adam lr 1e-3",
        "widths": [512, 1024, 1024, 1024, 64], "teacher": [512, 1024, 64],
        "global_batch": 256, "steps": 100, "warmup": 10,
        "optimizer": {"name": "adam", "lr": 0.001},
    },
    "tiny": {
        "title": "tiny MLP 64,64,64,10 (8,970 parameters), global batch 32, Adam lr 1e-3",
        "widths": [64, 64, 64, 10], "teacher": [64, 64, 10],
        "global_batch": 32, "steps": 2000, "warmup": 200,
        "optimizer": {"name": "adam", "lr": 0.001},
        # Its steps are the fixed cost per step and little else: shard.torch must not cost more
        # than plain torch's Adam step. The built-in MLP's targets are the medium MLP's.
        "targets": {("shard1", "plain"): 1.0, ("worker2", "ddp2"): None,
                    ("worker2", "worker1"): None},
        # Its 0.1-0.5 ms of compute leave no room for a fixed cost of 10%: its targets are the
        # ratios to plain torch and DDP (shard1/plain, shard2/ddp2), not step/fwd+bwd.
        "step_over_compute": None,
    },
    "transformer": {
        "title": ("example transformer (vocab 64, dim 64, 4 heads, 2 layers, context 32), "
                  "global batch 32, AdamW lr 3e-3 betas 0.9,0.95 wd 0.1 with a no-decay group, "
                  "clipping 1.0"),
        "global_batch": 32, "steps": 300, "warmup": 30,
        "optimizer": {"name": "adamw", "lr": 0.003, "betas": [0.9, 0.95], "weightDecay": 0.1,
                      "paramGroups": [{"match": ["*.bias", "*ln*", "*emb*"], "weightDecay": 0}]},
        "clip": 1.0,
    },
}
DEFAULT_MODELS = {"cpu": "mlp,tiny,transformer", "cuda": "mlp,transformer"}
CPU_CONFIGS = [  # (key, label, world size)
    ("plain", "plain torch W=1", 1),
    ("shard1", "shard.torch W=1 ZeRO-2", 1),
    ("ddp2", "DDP+ZeroRedundancyOpt W=2", 2),
    ("ddp2bv", "DDP+ZeRO bucket view W=2", 2),
    ("shard2", "shard.torch W=2 ZeRO-2", 2),
    ("shard2tcp", "shard.torch W=2 ZeRO-2 TCP", 2),
    ("shard2z3", "shard.torch W=2 ZeRO-3", 2),
    ("plainopt", "plain torch W=1 optim class", 1),
    ("shard1opt", "shard.torch W=1 optim class", 1),
    ("worker1", "shard-worker built-in W=1", 1),  # the MLPs only
    ("worker2", "shard-worker built-in W=2", 2),
]
CPU_OPTIONAL_CONFIGS = [  # run only when --configs names them
    ("shard4", "shard.torch W=4 ZeRO-2", 4),  # more ranks than a small machine has cores
    ("worker4", "shard-worker built-in W=4", 4),
]
# shard-worker trains its built-in MLP: only models given by widths have it.
BUILTIN_CONFIGS = {"worker1", "worker2", "worker4"}
# (numerator, denominator, target or None, primary: the issue's target, in the main table)
CPU_TARGETS = [
    ("shard1", "plain", 0.95, True),
    ("shard2", "ddp2", 1.2, True),
    ("shard2", "ddp2bv", 1.2, False),
    ("shard2z3", "shard2", 0.85, False),  # ZeRO-3 against ZeRO-2: the cost of gathering
    ("shard2z3", "ddp2", 1.2, False),
    ("shard1opt", "plainopt", 0.91, True),  # within 10%: 1/1.1
    ("shard2", "shard2tcp", None, False),  # what shared memory gains over TCP
    # The built-in MLP: 1.5 where plain torch's forward+backward of the whole batch is under
    # BUILTIN_FAST_CPU_MS, else BUILTIN_SLOW_CPU_TARGET (driver_main).
    ("worker2", "ddp2", 1.5, True),
    ("worker2", "worker1", 1.3, False),
]
BUILTIN_FAST_CPU_MS = 40.0
BUILTIN_SLOW_CPU_TARGET = 1.2
# Step time over the rank's own forward+backward in it, at most (shard.torch's and
# shard-worker's on the CPU; a model's "step_over_compute" overrides it): what a step costs
# beyond the compute it cannot avoid.
STEP_OVER_COMPUTE_TARGET = 1.1
GPU_CONFIGS = [
    ("plain", "plain torch (fused Adam)", 1),
    ("shard1", "shard.torch W=1 (NCCL)", 1),
    ("worker1", "shard-worker built-in MLP", 1),
    ("fsdp1", "torch FSDP2 fully_shard W=1", 1),
    ("shard1z3", "shard.torch W=1 ZeRO-3", 1),
]
GPU_TARGETS = [
    ("shard1", "plain", 0.95, True),
    ("worker1", "plain", 0.95, True),
    ("shard1z3", "fsdp1", 1.0, False),
]
ALL_KEYS = {key for key, _, _ in CPU_CONFIGS + CPU_OPTIONAL_CONFIGS + GPU_CONFIGS}


def configurations(model, device, only=None):
    """The configurations run for `model` on `device` (those in the default set, or of all the
    device's, the keys in `only` when given), and the ratios reported: those whose two sides
    run, with the model's own targets."""
    if not device.startswith("cuda"):
        configs, optional, targets = CPU_CONFIGS, CPU_OPTIONAL_CONFIGS, CPU_TARGETS
        if "widths" not in MODELS[model]:
            configs = [c for c in configs if c[0] not in BUILTIN_CONFIGS]
            optional = [c for c in optional if c[0] not in BUILTIN_CONFIGS]
    elif "widths" in MODELS[model]:
        configs, optional, targets = GPU_CONFIGS, [], GPU_TARGETS
    else:
        configs = [c for c in GPU_CONFIGS if c[0] != "worker1"]
        optional = []
        targets = [t for t in GPU_TARGETS if t[0] != "worker1"]
    if only is not None:
        configs = [c for c in configs + optional if c[0] in only]
    keys = {c[0] for c in configs}
    own = MODELS[model].get("targets", {})
    return configs, [(num, den, own.get((num, den), target), primary)
                     for num, den, target, primary in targets if num in keys and den in keys]


def step_over_compute_target(model, config, device):
    """The step/fwd+bwd target of `config`, or None: shard.torch's and shard-worker's on the
    CPU (a GPU's split times kernel launches, not the work), for the models that have one, over
    the transport a host's ranks use (shard2tcp, TCP as across hosts, is shown beside it)."""
    if (device.startswith("cuda") or not config.startswith(("shard", "worker"))
            or config.endswith("tcp")):
        return None
    return MODELS[model].get("step_over_compute", STEP_OVER_COMPUTE_TARGET)


LOSS_CHECK_STEPS = 3


# ---------------------------------------------------------------------------------------------
# Worker: one process of one configuration.
# ---------------------------------------------------------------------------------------------

def worker_main(args):
    import torch
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    sys.path.insert(0, EXAMPLES)
    spec = MODELS[args.model]
    device = torch.device(args.device)

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)

    torch.manual_seed(0)
    if "widths" in spec:
        from mlp import Mlp
        from shard.safetensors import load_file
        data = load_file(args.data)
        x, y = data["x"].to(device), data["y"].to(device)
        model = Mlp(spec["widths"]).to(device)
        loss_fn = torch.nn.CrossEntropyLoss()

        def loss_of(idx):
            idx = idx.to(device)
            with autocast():
                return loss_fn(model(x[idx]), y[idx])
        n = len(x)
    else:
        from transformer import Gpt, markov_sequences
        vocab, dim, heads, layers, context = 64, 64, 4, 2, 32  # the example's defaults
        tokens = markov_sequences(4096, context, vocab, 0).to(device)
        model = Gpt(vocab, dim, heads, layers, context).to(device)
        loss_fn = torch.nn.CrossEntropyLoss()

        def loss_of(idx):
            batch = tokens[idx.to(device)]
            with autocast():
                logits = model(batch[:, :-1])
                return loss_fn(logits.reshape(-1, vocab), batch[:, 1:].reshape(-1))
        n = len(tokens)

    total = args.warmup + args.steps + 1  # the top of step warmup+steps ends the timing
    clock = Clock(args.warmup, args.steps)
    if args.mode == "fsdp":  # FSDP2 on a world of one: torch's own sharding machinery, timed
        import torch.distributed as dist
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch 2.4-2.5
            from torch.distributed._composable.fsdp import fully_shard
        dist.init_process_group("nccl", init_method=f"file://{args.store}", rank=0, world_size=1)
        for module in model.modules():
            if type(module).__name__ == "Block":
                fully_shard(module)
        fully_shard(model)
    if args.mode in ("plain", "fsdp"):  # the same loop; FSDP's hooks gather and shard
        if args.own_optimizer:  # as a script that brings its class writes it
            cls, groups, settings = script_optimizer(torch, spec)
            optimizer = cls(by_pattern(groups, model.named_parameters()), **settings)
        else:
            optimizer = torch_optimizer(torch, model.parameters, model.named_parameters(), spec,
                                        fused=device.type == "cuda")
        batch = spec["global_batch"]
        for step in range(total):
            clock.top(step)
            idx = torch.arange(step * batch, (step + 1) * batch, dtype=torch.int64) % n
            optimizer.zero_grad(set_to_none=True)
            loss = loss_of(idx)
            loss.backward()
            clock.computed()
            if spec.get("clip"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), spec["clip"])
            optimizer.step()
            clock.stepped()
            clock.loss(loss.item())
        rank, world = 0, 1
    elif args.mode == "ddp":
        import torch.distributed as dist
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel
        dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=args.rank,
                                world_size=args.world)
        rank, world = dist.get_rank(), dist.get_world_size()
        ddp = DistributedDataParallel(model)  # bucket_cap_mb 25, as Shard's default
        optimizer = torch_optimizer(torch, model.parameters, model.named_parameters(), spec,
                                    zero=ZeroRedundancyOptimizer,
                                    bucket_view=args.zero_bucket_view)
        batch = spec["global_batch"]
        share = batch // world
        forward = ddp
        if "widths" in spec:
            def loss_of(idx):  # noqa: F811  (through DDP's forward, which arms its hooks)
                return loss_fn(forward(x[idx]), y[idx])
        else:
            def loss_of(idx):  # noqa: F811
                b = tokens[idx]
                return loss_fn(forward(b[:, :-1]).reshape(-1, vocab), b[:, 1:].reshape(-1))
        for step in range(total):
            clock.top(step)
            first = step * batch + rank * share
            idx = torch.arange(first, first + share, dtype=torch.int64) % n
            optimizer.zero_grad(set_to_none=True)
            loss = loss_of(idx)
            loss.backward()  # DDP all-reduces the buckets during backward and waits at its end
            clock.computed()
            if spec.get("clip"):  # the gradients are whole and averaged: the local norm is global
                torch.nn.utils.clip_grad_norm_(model.parameters(), spec["clip"])
            optimizer.step()  # this rank's shard of Adam, then broadcasts from each owner
            clock.stepped()
            clock.loss(loss.item())
    else:  # shard: the loop of docs/torch.md
        import shard.torch as shard
        job = shard.join(device=args.device)
        engine = job.wrap(model)
        step_fn = engine.step
        if args.own_optimizer:  # the job spec's optimizer is "torch": the script brings its class
            cls, groups, settings = script_optimizer(torch, spec)
            step_fn = engine.optimizer(cls, groups, **settings).step  # Shard's whole step
        for step in job.steps():
            clock.top(step)
            loss = loss_of(job.batch_indices(step, n))
            loss.backward()
            clock.computed()
            step_fn()
            clock.stepped()
            value = loss.item()
            job.report(loss=value)
            clock.loss(value)
        rank, world = job.rank, job.world_size
        job.finish()
        if world != args.world:
            raise SystemExit(f"shard world size {world}, expected {args.world}")
    result = clock.result()
    result.update(rank=rank, world=world, mode=args.mode, model=args.model,
                  torch=torch.__version__, threads=torch.get_num_threads(), device=args.device,
                  gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None)
    with open(f"{args.result}.rank{rank}.json", "w") as f:
        json.dump(result, f)
    if args.mode == "fsdp":
        dist.destroy_process_group()
    if args.mode == "ddp":
        # torch 1.13 can deadlock at interpreter exit: ProcessGroupGloo's destructor (run when
        # DDP's Reducer is collected) joins a gloo thread that is freeing a tensor and waits for
        # the GIL the destructor holds. Both ranks are done once they pass the barrier.
        dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def torch_optimizer(torch, parameters, named, spec, zero=None, bucket_view=False, fused=False):
    """The job spec's optimizer as torch.optim: single-tensor arithmetic, as Shard's on the CPU;
    `fused` (a GPU) torch's fastest, the fused multi-tensor kernel."""
    opt = spec["optimizer"]
    cls = torch.optim.Adam if opt["name"] == "adam" else torch.optim.AdamW
    kwargs = {"lr": opt["lr"], **({"fused": True} if fused else {"foreach": False})}
    if "betas" in opt:
        kwargs["betas"] = tuple(opt["betas"])
    kwargs["weight_decay"] = opt.get("weightDecay", 0.0)
    groups = list(parameters())
    if opt.get("paramGroups"):
        import fnmatch
        patterns = opt["paramGroups"][0]["match"]
        named = list(named)
        plain = [p for name, p in named if not any(fnmatch.fnmatchcase(name, m) for m in patterns)]
        no_decay = [p for name, p in named if any(fnmatch.fnmatchcase(name, m) for m in patterns)]
        groups = [{"params": plain},
                  {"params": no_decay, "weight_decay": opt["paramGroups"][0]["weightDecay"]}]
    if zero is not None:
        return zero(groups, optimizer_class=cls, parameters_as_bucket_view=bucket_view, **kwargs)
    return cls(groups, **kwargs)


def script_optimizer(torch, spec):
    """The job spec's optimizer as a script that brings its own writes it: (the torch.optim
    class, param groups by name pattern or None for every parameter, settings). The same
    arithmetic as torch_optimizer's (single-tensor, foreach=False); the no-decay group comes
    first and a last group "*" takes the rest, as engine.optimizer resolves patterns."""
    opt = spec["optimizer"]
    cls = torch.optim.Adam if opt["name"] == "adam" else torch.optim.AdamW
    settings = {"lr": opt["lr"], "weight_decay": opt.get("weightDecay", 0.0), "foreach": False}
    if "betas" in opt:
        settings["betas"] = tuple(opt["betas"])
    groups = None
    if opt.get("paramGroups"):
        groups = [{"params": list(g["match"]), "weight_decay": g["weightDecay"]}
                  for g in opt["paramGroups"]] + [{"params": ["*"]}]
    return cls, groups, settings


def by_pattern(groups, named):
    """Param groups whose "params" are name patterns, resolved to parameters as
    engine.optimizer does (a pattern takes the parameters no earlier group took; None: every
    parameter), for plain torch."""
    import fnmatch
    named = [(name, p) for name, p in named if p.requires_grad]
    if groups is None:
        return [p for _, p in named]
    taken, resolved = set(), []
    for group in groups:
        chosen = [p for name, p in named if id(p) not in taken and
                  any(fnmatch.fnmatchcase(name, m) for m in group["params"])]
        taken.update(id(p) for p in chosen)
        resolved.append(dict(group, params=chosen))
    return resolved


class Clock:
    """Wall time from the top of step `warmup` to the top of step `warmup + steps`, and the
    timed steps' split: forward+backward (with the batch), step (optimizer or engine step, with
    clipping), rest (zero_grad, loss.item(), and for shard.torch the step boundary)."""

    def __init__(self, warmup, steps):
        self.warmup, self.steps = warmup, steps
        self.start = self.end = None
        self.t = self.compute = self.step = 0.0
        self.timing = False
        self.losses = []

    def loss(self, value):
        self.losses.append(value)

    def top(self, step):
        now = time.perf_counter()
        if step == self.warmup:
            self.start, self.timing = now, True
        elif step == self.warmup + self.steps:
            self.end, self.timing = now, False
        self.t = now

    def computed(self):
        now = time.perf_counter()
        if self.timing:
            self.compute += now - self.t
        self.t = now

    def stepped(self):
        now = time.perf_counter()
        if self.timing:
            self.step += now - self.t
        self.t = now

    def result(self):
        if self.start is None or self.end is None:
            raise SystemExit("the run ended before the timed steps were done")
        seconds = self.end - self.start
        per = 1000.0 / self.steps
        return {"seconds": seconds, "steps": self.steps, "warmup": self.warmup,
                "steps_per_second": self.steps / seconds,
                "ms_per_step": seconds * per, "compute_ms": self.compute * per,
                "step_ms": self.step * per,
                "rest_ms": (seconds - self.compute - self.step) * per,
                "first_loss": self.losses[0], "last_loss": self.losses[-1],
                "losses": self.losses}


# ---------------------------------------------------------------------------------------------
# Driver: runs the configurations as processes and prints the table.
# ---------------------------------------------------------------------------------------------

class RunFailed(Exception):
    pass


def worker_args(model, mode, steps, warmup, data, result, extra=()):
    """The arguments of this file for a worker process."""
    return ["worker", "--mode", mode, "--model", model, "--steps", str(steps), "--warmup",
            str(warmup), "--data", data or "", "--result", result, *extra]


def read_result(prefix, what):
    path = f"{prefix}.rank0.json"
    if not os.path.exists(path):
        raise RunFailed(f"{what}: rank 0 wrote no result ({path})")
    with open(path) as f:
        return json.load(f)


def start_coordinator(processes, run_dir, job, deadline, what):
    """A shard-coordinator for `job` (a dict) in `run_dir`, serving."""
    job_path = os.path.join(run_dir, "job.json")
    with open(job_path, "w") as f:
        json.dump(job, f)
    return processes.start_coordinator(job=job_path, state_dir=os.path.join(run_dir, "state"),
                                       name=f"{what} coordinator",
                                       log=os.path.join(run_dir, "coordinator.log"),
                                       timeout=deadline - time.monotonic())


def transport_in_log(path):
    """The transport a Shard rank's log names in its self-check ("... over 2 ranks (shm) ..."):
    shm, tcp (Gloo's, which the worker calls gloo), or a GPU's backend."""
    with open(path) as f:
        match = re.search(r"over \d+ ranks \(([^)]+)\)", f.read())
    name = match.group(1) if match else "?"
    return "tcp" if name == "gloo" else name


def run_builtin_worker(processes, run_dir, model, world, steps, warmup, data, device, bf16,
                       deadline, what):
    """shard-worker's built-in MLP of the model's widths on `device` at `world` ranks: rank 0's
    own steps/s over steps 2-N and its step over its forward+backward, from its log (the worker
    prints no per-step split)."""
    spec = MODELS[model]
    job = {"name": "bench-builtin", "worldSize": world,
           "model": {"mlp": {"widths": spec["widths"]}},
           "data": {"path": data}, "optimizer": spec["optimizer"],
           "globalBatch": spec["global_batch"], "steps": warmup + steps + 1, "zeroStage": 2,
           "precision": "bf16" if bf16 else "fp32", "checkpoint": {"everySteps": 0},
           "outputDir": os.path.join(run_dir, "out")}
    coordinator = start_coordinator(processes, run_dir, job, deadline, what)
    workers = [processes.start_worker(f"w{i}", coordinator.address, "--device", device,
                                      name=f"{what} w{i}", log=os.path.join(run_dir, f"w{i}.log"))
               for i in range(world)]
    wait_all(workers + [coordinator], deadline - time.monotonic())
    summaries = [(worker, line) for worker in workers for line in worker.log().splitlines()
                 if " rank=0 " in line and "training finished:" in line]
    if len(summaries) != 1:
        raise RunFailed(f"{what}: no rank 0 summary in the workers' logs\n{workers[0].tail()}")
    worker, summary = summaries[0]
    match = re.search(r"loss ([0-9.e+-]+) -> ([0-9.e+-]+), ([0-9.]+) steps/s", summary)
    if not match:
        raise RunFailed(f"{what}: the worker reported no steps/s\n{worker.tail()}")
    rate = float(match.group(3))
    nan = float("nan")
    # "a step 1.07x its forward and backward": the mean step over the mean forward+backward.
    efficiency = re.search(r"a step ([0-9.]+)x its forward and backward", summary)
    ms = 1000.0 / rate
    return {"steps_per_second": rate, "ms_per_step": ms,
            "compute_ms": ms / float(efficiency.group(1)) if efficiency else nan,
            "step_ms": nan, "rest_ms": nan, "losses": [float(match.group(1))], "torch": None,
            "transport": transport_in_log(worker.log_path) if world > 1 else "-"}


def run_config(processes, timeout, model, config, world, steps, warmup, data, tag, device="cpu",
               bf16=False):
    """One run of `config` (a key of the configuration lists) at `world` ranks, all its processes
    within `timeout` seconds: rank 0's result, with the transport its ranks exchanged data
    over."""
    run_dir = os.path.join(processes.dir, tag)
    os.makedirs(run_dir)
    result = os.path.join(run_dir, "result")
    deadline = time.monotonic() + timeout
    what = f"{model} {config}"
    target = ["--device", device] + (["--bf16"] if bf16 else [])
    if config in BUILTIN_CONFIGS:
        result = run_builtin_worker(processes, run_dir, model, world, steps, warmup, data, device,
                                    bf16, deadline, what)
        processes.stop()
        return result
    own = ["--own-optimizer"] if config in ("plainopt", "shard1opt") else []
    transport = "-"  # one process: nothing exchanged
    if config in ("plain", "plainopt"):
        proc = processes.start_python(
            what, [BENCH, *worker_args(model, "plain", steps, warmup, data, result, target + own)],
            log=os.path.join(run_dir, "plain.log"))
        wait_all([proc], deadline - time.monotonic())
    elif config == "fsdp1":
        proc = processes.start_python(
            what, [BENCH, *worker_args(model, "fsdp", steps, warmup, data, result,
                                       target + ["--store", os.path.join(run_dir, "store")])],
            log=os.path.join(run_dir, "fsdp.log"))
        wait_all([proc], deadline - time.monotonic())
        transport = "nccl"
    elif config in ("ddp2", "ddp2bv"):
        ddp_extra = ["--zero-bucket-view"] if config == "ddp2bv" else []
        store = os.path.join(run_dir, "store")
        procs = [processes.start_python(
            f"{what} rank {r}",
            [BENCH, *worker_args(model, "ddp", steps, warmup, data, result,
                                 ["--rank", str(r), "--world", "2", "--store", store,
                                  *ddp_extra])],
            log=os.path.join(run_dir, f"ddp{r}.log"),
            env={"GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"})
            for r in range(2)]
        wait_all(procs, deadline - time.monotonic())
        transport = "gloo tcp"
    else:
        spec = MODELS[model]
        job = {"name": f"bench-{model}", "worldSize": world, "model": {"external": {}},
               "optimizer": {"name": "torch"} if own else spec["optimizer"],
               "globalBatch": spec["global_batch"],
               "steps": warmup + steps + 1, "zeroStage": 3 if config.endswith("z3") else 2,
               "checkpoint": {"everySteps": 0}, "outputDir": os.path.join(run_dir, "out")}
        if spec.get("clip"):
            job["gradClipNorm"] = spec["clip"]
        coordinator = start_coordinator(processes, run_dir, job, deadline, what)
        workers = [processes.start_worker(
            f"w{i}", coordinator.address,
            *worker_args(model, "shard", steps, warmup, data, result,
                         ["--world", str(world), *target, *own]),
            script=BENCH, name=f"{what} w{i}", log=os.path.join(run_dir, f"w{i}.log"),
            env={"SHARD_TRANSPORT": "tcp" if config == "shard2tcp" else "auto"})
            for i in range(world)]
        wait_all(workers + [coordinator], deadline - time.monotonic())
        transport = transport_in_log(workers[0].log_path)
    processes.stop()
    return dict(read_result(result, what), transport=transport)


def summarize(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "values": values}


def cpu_model():
    """The CPU's model name, as /proc/cpuinfo gives it (another system: platform's guess)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "cpu model"):
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average():
    try:
        with open("/proc/loadavg") as f:
            return [float(v) for v in f.read().split()[:3]]
    except OSError:
        return None


def driver_main(args):
    models = args.models or DEFAULT_MODELS["cuda" if args.device.startswith("cuda") else "cpu"]
    models = [m.strip() for m in models.split(",") if m.strip()]
    for m in models:
        if m not in MODELS:
            print(f"torch_bench: unknown model '{m}' ({', '.join(MODELS)})", file=sys.stderr)
            return 2
    only = None
    if args.configs:
        only = {c.strip() for c in args.configs.split(",") if c.strip()}
        known = {key for m in models for key, _, _ in configurations(m, args.device, only)[0]}
        unknown = sorted(only - known)
        if unknown or not only:
            every = {key for m in models
                     for key, _, _ in configurations(m, args.device, ALL_KEYS)[0]}
            print(f"torch_bench: unknown configuration {', '.join(unknown) or '(none)'} on "
                  f"{args.device} ({', '.join(sorted(every))})", file=sys.stderr)
            return 2
    for binary in ("shard-coordinator", "shard-worker", "shardctl"):
        if not os.path.exists(os.path.join(BIN, binary)):
            print(f"torch_bench: {BIN}/{binary} is missing: run scripts/build.sh", file=sys.stderr)
            return 1
    run_dir = tempfile.mkdtemp(prefix="shard-bench-torch.")
    # One compute thread in every process, as the table says.
    processes = Processes(run_dir, BUILD, env=dict(os.environ, **ONE_THREAD))

    def cleanup():
        processes.stop()
        if not args.keep:
            shutil.rmtree(run_dir, ignore_errors=True)
    atexit.register(cleanup)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _: sys.exit(128 + signum))

    def log(message):
        print(message, file=sys.stderr, flush=True)

    started = datetime.datetime.now().astimezone()
    load_before = load_average()
    data = {}  # model: its data file, for the MLPs
    for model in models:
        if "teacher" not in MODELS[model]:
            continue
        data[model] = os.path.join(run_dir, f"{model}.safetensors")
        generated = subprocess.run(
            [os.path.join(BIN, "shardctl"), "data", "generate", "--widths",
             ",".join(map(str, MODELS[model]["teacher"])), "--samples", "16384", "--seed", "1",
             "--out", data[model]], capture_output=True, text=True, timeout=120)
        if generated.returncode != 0:
            log("torch_bench: shardctl data generate failed:\n" + generated.stdout +
                generated.stderr)
            return 1

    results = {}
    try:
        for model in models:
            steps = args.steps or MODELS[model]["steps"]
            warmup = args.warmup if args.warmup is not None else MODELS[model]["warmup"]
            configs, _ = configurations(model, args.device, only)
            runs = {key: [] for key, _, _ in configs}
            for repeat in range(args.repeats):
                for key, label, world in configs:
                    r = run_config(processes, args.timeout, model, key, world, steps, warmup,
                                   data.get(model, ""), f"{model}-{key}-{repeat}", args.device,
                                   args.bf16)
                    runs[key].append(r)
                    log(f"{model:12s} {label:28s} repeat {repeat + 1}/{args.repeats}: "
                        f"{r['steps_per_second']:.2f} steps/s ({r['ms_per_step']:.1f} ms/step: "
                        f"fwd+bwd {r['compute_ms']:.1f}, step {r['step_ms']:.1f}, "
                        f"rest {r['rest_ms']:.1f})")
            results[model] = {"steps": steps, "warmup": warmup, "runs": runs}
    except (RunFailed, ProcessError) as failure:
        log(f"torch_bench: {failure}")
        if args.keep:
            log(f"torch_bench: logs kept in {run_dir}")
        return 1

    report = {
        "date": started.isoformat(timespec="seconds"),
        "device": args.device, "precision": "bf16 autocast" if args.bf16 else "fp32",
        "host": platform.node(), "cpu": cpu_model(), "cores": os.cpu_count(),
        "load_before": load_before, "load_after": load_average(),
        "python": platform.python_version(),
        "threads_per_process": 1, "repeats": args.repeats,
        "configs_selected": sorted(only) if only else None,
        "models": {},
    }
    for model, res in results.items():
        configs = {}
        model_configs, model_targets = configurations(model, args.device, only)
        for key, label, world in model_configs:
            runs = res["runs"][key]
            configs[key] = {
                "label": label, "world_size": world,
                # what every run's ranks exchanged data over (one name unless runs differed)
                "transport": "/".join(sorted({r["transport"] for r in runs})),
                "steps_per_second": summarize([r["steps_per_second"] for r in runs]),
                "ms_per_step": statistics.median(r["ms_per_step"] for r in runs),
                "compute_ms": statistics.median(r["compute_ms"] for r in runs),
                "step_ms": statistics.median(r["step_ms"] for r in runs),
                "rest_ms": statistics.median(r["rest_ms"] for r in runs),
            }
            # The medians' quotient, so that the table's columns show how it came about; none
            # on a GPU, where the split times kernel launches.
            efficiency, target = None, step_over_compute_target(model, key, args.device)
            if not args.device.startswith("cuda"):
                efficiency = configs[key]["ms_per_step"] / configs[key]["compute_ms"]
                if math.isnan(efficiency):  # a log that did not say
                    efficiency, target = None, None
            configs[key]["step_over_compute"] = {
                "ratio": efficiency, "target": target,
                "pass": None if target is None else efficiency <= target}
            if runs[0]["torch"]:
                report["torch"] = runs[0]["torch"]
                report["gpu"] = runs[0].get("gpu")
        ratios = []
        for num, den, target, primary in model_targets:
            if ((num, den) == ("worker2", "ddp2") and target is not None and "plain" in configs
                    and configs["plain"]["compute_ms"] >= BUILTIN_FAST_CPU_MS):
                target = BUILTIN_SLOW_CPU_TARGET
            ratio = (configs[num]["steps_per_second"]["median"] /
                     configs[den]["steps_per_second"]["median"])
            # The same training in both: rank 0's losses of the first steps (the same start,
            # samples and updates) agree to float32 rounding. Later ones drift apart as rounding
            # differences grow through training (torch 1.13's Adam rounds its moments unlike
            # torch 2's lerp, which Shard follows), so only the first few are compared.
            a = res["runs"][num][0]["losses"][:LOSS_CHECK_STEPS]
            b = res["runs"][den][0]["losses"][:LOSS_CHECK_STEPS]
            loss_difference = max(abs(u - v) / max(abs(v), 1e-12) for u, v in zip(a, b))
            if num in BUILTIN_CONFIGS and den not in BUILTIN_CONFIGS:
                # the built-in MLP starts from its own initial values
                loss_difference = float("nan")
            # bf16 autocast rounds differently in torch's and Shard's runs once the weights
            # differ in their last bits: only fp32 must agree this closely.
            elif loss_difference > (1e-2 if args.bf16 else 1e-4):
                log(f"torch_bench: warning: {model} {num} and {den} do not train alike: rank 0's "
                    f"losses of the first steps {a} against {b}")
            ratios.append({"of": num, "over": den, "ratio": ratio, "target": target,
                           "primary": primary,
                           "pass": None if target is None else ratio >= target,
                           "first_losses": [a, b], "loss_relative_difference": loss_difference})
        report["models"][model] = {"title": MODELS[model]["title"], "steps": res["steps"],
                                   "warmup": res["warmup"], "configs": configs,
                                   "ratios": ratios}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    return 0


def print_table(report):
    load = report["load_before"]
    where = report["device"] + (f" ({report['gpu']})" if report.get("gpu") else "")
    print(f"# shard.torch vs PyTorch, {report['date']}, {report['host']}, {report['cpu']}, "
          f"{report['cores']} cores, {where}, {report['precision']}, torch {report.get('torch')}, "
          f"1 thread per process, median of {report['repeats']} [min-max]")
    if load:
        print(f"# load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; after: "
              + " ".join(f"{v:.2f}" for v in report["load_after"] or [])
              + " (the run's own processes included)")
        if load[0] >= 1.0:
            print(f"# warning: the 1-minute load was {load[0]:.2f} before the run: other work "
                  "shares the cores, so the W=2 runs (a process per core) are not trustworthy")
    for model, m in report["models"].items():
        print(f"# {model}: {m['title']}; {m['steps']} timed steps after {m['warmup']} warm-up")
    if not report["device"].startswith("cuda"):
        print(f"# step/fwd+bwd: ms/step over rank 0's forward+backward ms in it (the medians); "
              f"target <= {STEP_OVER_COMPUTE_TARGET:.2f} for shard.torch and shard-worker "
              f"(whose is its log's summary) on the medium MLP and the transformer")
    print()
    print(f"| {'model':11s} | {'configuration':28s} | {'transport':9s} | "
          f"{'steps/s (median [min-max])':27s} | {'ms/step: fwd+bwd / step / rest':30s} | "
          f"{'step/fwd+bwd':12s} | {'ratio':14s} | {'target':6s} | result |")
    print(f"|{'-' * 13}|{'-' * 30}|{'-' * 11}|{'-' * 29}|{'-' * 32}|{'-' * 14}|{'-' * 16}|"
          f"{'-' * 8}|--------|")
    for model, m in report["models"].items():
        ratio_of = {r["of"]: r for r in m["ratios"] if r["primary"]}
        for key, c in m["configs"].items():
            label = c["label"]
            s = c["steps_per_second"]
            rate = f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]"
            split = (f"{c['ms_per_step']:.2f}: " + " / ".join(
                "-" if math.isnan(c[part]) else f"{c[part]:.2f}"
                for part in ("compute_ms", "step_ms", "rest_ms")))
            e = c["step_over_compute"]
            efficiency = "-" if e["ratio"] is None else f"{e['ratio']:.2f}"
            if e["target"] is not None:
                if e["pass"] is False and efficiency == f"{e['target']:.2f}":
                    efficiency = f"{e['ratio']:.3f}"  # a miss by less than the rounding
                efficiency += " PASS" if e["pass"] else " MISS"
            ratio, target, result = "", "", ""
            if key in ratio_of:
                r = ratio_of[key]
                ratio = f"{r['ratio']:.2f}x {r['over']}"
                if r["target"] is not None:
                    target = f">={r['target']:.2f}"
                    result = "PASS" if r["pass"] else "MISS"
            print(f"| {model:11s} | {label:28s} | {c['transport']:9s} | {rate:27s} | "
                  f"{split:30s} | {efficiency:12s} | {ratio:14s} | {target:6s} | {result:6s} |")
    print()
    for model, m in report["models"].items():
        for r in m["ratios"]:
            if not r["primary"]:
                verdict = ("no target" if r["target"] is None else
                           f"target >={r['target']:.2f}: {'PASS' if r['pass'] else 'MISS'}")
                print(f"# {model}: {r['of']} / {r['over']} = {r['ratio']:.2f}x ({verdict})")
    pairs = [f"{model} {r['of']}/{r['over']} {r['loss_relative_difference']:.1e}"
             for model, m in report["models"].items() for r in m["ratios"]]
    if pairs:
        print(f"# same training in each pair: largest relative difference of rank 0's losses "
              f"over the first {LOSS_CHECK_STEPS} steps: " + "; ".join(pairs))
    missed = [f"{model} {r['of']}/{r['over']} {r['ratio']:.2f}x < {r['target']:.2f}"
              for model, m in report["models"].items() for r in m["ratios"]
              if r["pass"] is False]
    missed += [f"{model} {key} step/fwd+bwd {c['step_over_compute']['ratio']:.3f} > "
               f"{c['step_over_compute']['target']:.2f}"
               for model, m in report["models"].items() for key, c in m["configs"].items()
               if c["step_over_compute"]["pass"] is False]
    print("# targets missed: " + ("; ".join(missed) if missed else "none"))


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    worker = sub.add_parser("worker", help="one process of one configuration (run by the driver)")
    worker.add_argument("--mode", choices=["plain", "ddp", "fsdp", "shard"], required=True)
    worker.add_argument("--model", choices=sorted(MODELS), required=True)
    worker.add_argument("--steps", type=int, required=True)
    worker.add_argument("--warmup", type=int, required=True)
    worker.add_argument("--data", default="")
    worker.add_argument("--result", required=True, help="rank r writes RESULT.rank<r>.json")
    worker.add_argument("--rank", type=int, default=0)
    worker.add_argument("--world", type=int, default=1)
    worker.add_argument("--store", help="DDP's file store")
    worker.add_argument("--zero-bucket-view", action="store_true",
                        help="ZeroRedundancyOptimizer(parameters_as_bucket_view=True)")
    worker.add_argument("--own-optimizer", action="store_true",
                        help="the optimizer as a script brings it: plain, the torch.optim class "
                        "over groups by name pattern; shard, engine.optimizer(class) and "
                        "opt.step()")
    worker.add_argument("--device", default="cpu")
    worker.add_argument("--bf16", action="store_true")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per run (default: " +
                        ", ".join(f"{m} {spec['steps']}" for m, spec in MODELS.items()) + ")")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed steps before them (default: " +
                        ", ".join(f"{m} {spec['warmup']}" for m, spec in MODELS.items()) + ")")
    parser.add_argument("--repeats", type=int, default=3, help="runs per configuration (3)")
    parser.add_argument("--models", default=None,
                        help=f"of {','.join(MODELS)} (default: {DEFAULT_MODELS['cpu']} on the "
                        f"cpu, {DEFAULT_MODELS['cuda']} on a GPU)")
    parser.add_argument("--configs", default=None,
                        help="only these configurations, e.g. plainopt,shard1opt (default on "
                        "the cpu: " + ",".join(key for key, _, _ in CPU_CONFIGS) + "; also "
                        + ",".join(key for key, _, _ in CPU_OPTIONAL_CONFIGS) + " when named)")
    parser.add_argument("--device", default="cpu",
                        help="cpu (default) or cuda:N: on a GPU, plain torch, shard.torch and "
                        "shard-worker on that GPU")
    parser.add_argument("--bf16", action="store_true",
                        help="forward and backward under torch.autocast in bf16 (shard-worker: "
                        "precision bf16)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--timeout", type=float, default=300,
                        help="seconds one run (all its processes) may take (300)")
    parser.add_argument("--keep", action="store_true", help="keep the run directory and logs")
    args = parser.parse_args()
    if args.command == "worker":
        if args.warmup < 1 or args.steps < 1:
            parser.error("--warmup and --steps must be at least 1")
        worker_main(args)
        return 0
    if (args.steps is not None and args.steps < 1) or (args.warmup is not None and
                                                        args.warmup < 1) or args.repeats < 1:
        parser.error("--steps, --warmup and --repeats must be at least 1")
    return driver_main(args)


if __name__ == "__main__":
    sys.exit(main())
