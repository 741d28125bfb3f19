"""One rank of the DDP reference of test_torch.py: the example models trained with torch's own
data parallelism, DistributedDataParallel (gloo) with ZeroRedundancyOptimizer (plain DDP for
ZeRO stage 0), on the same shares of the same global batches. Rank 0 saves the parameters.

    ddp_reference.py --rank R --world W --store FILE --config JSON --out FILE
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_torch import make_model_and_data, torch_optimizer  # noqa: E402
from shard.safetensors import save_file  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = json.loads(args.config)
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=args.rank,
                            world_size=args.world)
    model, inputs, targets, loss_of = make_model_and_data(config)
    ddp = DistributedDataParallel(model)
    if config["stage"] == 0:
        optimizer = torch_optimizer(config, model.parameters())
    else:
        optimizer = torch_optimizer(config, model.parameters(), zero=ZeroRedundancyOptimizer)
    batch = config["batch"]
    share = batch // args.world
    for step in range(config["steps"]):
        first = step * batch + args.rank * share
        idx = torch.arange(first, first + share) % len(inputs)
        optimizer.zero_grad()
        loss_of(ddp(inputs[idx]), targets[idx]).backward()
        optimizer.step()
    if args.rank == 0:
        save_file(model.state_dict(), args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
