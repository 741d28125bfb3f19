"""A shard.torch worker that trains with the script's own torch.optim class (tests of
test_torch_optim.py): the MLP (or a model with tied weights), two param groups, a LambdaLR
warm-up kept in job.checkpoint_extras, and, when asked, consolidated_state_dict(to=0) after a
given step with each rank's peak memory during it.

    python3 optim_worker.py --config '{"optimizer": "AdamW", "widths": [16, 32, 8], ...}'
"""

import argparse
import json
import os
import re
import sys
import time

import torch

import shard.torch as shard
from shard.safetensors import load_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples",
                                "torch"))
from mlp import Mlp  # noqa: E402


class Factored(torch.optim.Optimizer):
    """A shape-aware optimizer (Adafactor's factored second moment): a matrix keeps one moment
    per row and one per column, whose outer product stands for the elementwise one; a vector
    keeps a moment per element. Its step count is a Python int."""

    def __init__(self, params, lr=0.01, beta2=0.99, eps=1e-8):
        super().__init__(params, dict(lr=lr, beta2=beta2, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta2 = group["beta2"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    if p.dim() == 2:
                        state["row"] = torch.zeros(p.shape[0], device=p.device)
                        state["col"] = torch.zeros(p.shape[1], device=p.device)
                    else:
                        state["square"] = torch.zeros_like(p)
                state["step"] += 1
                squared = p.grad * p.grad + group["eps"]
                if p.dim() == 2:
                    state["row"].mul_(beta2).add_(squared.mean(1), alpha=1 - beta2)
                    state["col"].mul_(beta2).add_(squared.mean(0), alpha=1 - beta2)
                    second = torch.outer(state["row"], state["col"]) / state["row"].mean()
                else:
                    state["square"].mul_(beta2).add_(squared, alpha=1 - beta2)
                    second = state["square"]
                corrected = second / (1 - beta2 ** state["step"])
                p.add_(p.grad / corrected.sqrt(), alpha=-group["lr"])


# The class, its settings, and the second (bias) group's own settings.
OPTIMIZERS = {
    "AdamW": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}, {"weight_decay": 0.0}),
    "RMSprop": (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.9, "centered": True},
                {"lr": 0.005}),
    "Adagrad": (torch.optim.Adagrad, {"lr": 0.05}, {"lr": 0.1}),
    "Factored": (Factored, {"lr": 0.01}, {"lr": 0.02}),
    "SGD": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
            {"lr": 0.1}),
}
WARMUP = 15  # longer than the 10 steps before a restore: the schedule must come back


def warmup(count):
    """LambdaLR's factor after `count` updates: linear warm-up over WARMUP updates."""
    return min(1.0, (count + 1) / WARMUP)


class Tied(torch.nn.Module):
    """An embedding whose weight the output layer shares (tied weights), and a hidden layer."""

    def __init__(self, vocab, dim):
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab, dim)
        self.hidden = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, tokens):
        return self.head(torch.relu(self.hidden(self.embedding(tokens))))


def build(config):
    """The model, its inputs and targets, and the torch optimizer over its two groups (weights,
    biases) as a plain torch script would make them: the reference does the same."""
    torch.manual_seed(5)
    if config.get("tied"):
        model = Tied(16, 8)
        tokens = torch.randint(0, 16, (512,), generator=torch.Generator().manual_seed(3))
        inputs, targets = tokens, (tokens * 3 + 1) % 16
    else:
        model = Mlp(config["widths"])
        data = load_file(config["data"])
        inputs, targets = data["x"], data["y"]
    return model, inputs, targets


def groups(model, config, by_name):
    """The two param groups: by name pattern (as Shard takes them) or by parameter."""
    _, _, bias_settings = OPTIMIZERS[config["optimizer"]]
    if by_name:
        return [{"params": "*.weight"}, dict(bias_settings, params="*.bias")]
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n.endswith(".weight")]},
            dict(bias_settings, params=[p for n, p in named if n.endswith(".bias")])]


def peak_memory(run):
    """Runs `run()`; returns its result and how far this process's resident memory rose above
    where it stood before (bytes): the peak is reset first (/proc/self/clear_refs)."""
    def status(field):
        with open("/proc/self/status") as f:
            return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)) * 1024

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    result = run()
    return result, status("VmHWM") - before


def hold_at_gates(job, step, gates):
    """Holds the step at each gate of the config not yet passed whose world size is this world's
    and whose step it has reached, until the test opens it (creates its file): the test then acts
    on a job that is known to be at that point and not past it."""
    for gate in gates:
        if gate.get("passed") or job.world_size != gate["world"] or step < gate["step"]:
            continue
        print(f"at the gate of step {gate['step']} in a world of {gate['world']}", flush=True)
        deadline = time.monotonic() + 60
        while not os.path.exists(gate["file"]):
            if time.monotonic() > deadline:
                sys.exit(f"the gate {gate['file']} did not open within 60 s")
            time.sleep(0.01)
        gate["passed"] = True


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    config = json.loads(parser.parse_args().config)
    torch.set_num_threads(1)
    model, inputs, targets = build(config)
    optimizer_class, settings, _ = OPTIMIZERS[config["optimizer"]]
    # Going on from a plain torch run's state_dicts, `offset` steps into the data.
    resumed = torch.load(config["resume"]) if "resume" in config else None
    if resumed is not None:
        model.load_state_dict(resumed["model"])
    job = shard.join()
    model.to(job.device)
    inputs, targets = inputs.to(job.device), targets.to(job.device)
    engine = job.wrap(model)
    opt = engine.optimizer(optimizer_class, groups(model, config, by_name=True), **settings)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    if resumed is not None:
        opt.load_state_dict(resumed["optimizer"])
        schedule.load_state_dict(resumed["schedule"])
    job.checkpoint_extras["schedule"] = schedule
    offset = config.get("offset", 0)
    gates = config.get("gates", [])
    for step in job.steps():
        hold_at_gates(job, step, gates)
        idx = job.batch_indices(step + offset, len(inputs)).to(job.device)
        loss = torch.nn.functional.cross_entropy(model(inputs[idx]), targets[idx])
        loss.backward()
        opt.step()
        schedule.step()
        job.report(loss=loss.item())
        if step + 1 == config.get("consolidate_after"):
            state, grown = peak_memory(lambda: engine.consolidated_state_dict(to=0))
            largest = max(p.numel() * 4 for p in model.parameters())
            print("consolidation memory " + json.dumps(
                {"rank": job.rank, "grown": grown, "largest_param_bytes": largest}), flush=True)
            # The optimizer's own consolidate_state_dict gives rank 0 the same state_dict.
            opt.consolidate_state_dict(to=0)
            if job.rank == 0:
                torch.save(state, config["consolidated"])
                same = repr(opt.state_dict()) == repr(state["optimizer"])
                print(f"opt.state_dict() {'equals' if same else 'differs from'} "
                      "engine.consolidated_state_dict()", flush=True)
    path = job.finish()
    if path:
        print(f"parameters written to {path}")


if __name__ == "__main__":
    main()
