"""The built-in MLP's math as a PyTorch model on Shard: Linear layers with ReLU between them,
mean softmax cross-entropy, trained with the optimizer, ZeRO stage and checkpoints of the
coordinator's job spec ("model": {"external": {}}). One process per rank:

    SHARD_COORDINATOR=127.0.0.1:7460 python3 examples/torch/mlp.py --data data.safetensors

On a GPU: SHARD_DEVICE=cuda:0 (and --bf16 to compute under torch.autocast in bf16; Shard keeps
the parameters and gradients in fp32).

The data file holds x (F32 [N, in]) and y (I64 [N]), e.g. from `shardctl data generate` (512
features and 64 classes make the medium MLP 512,1024,1024,1024,64). Every rank builds the model
from the same seed; the engine starts from rank 0's values anyway.
"""

import argparse

import torch

import shard.torch as shard
from shard.safetensors import load_file


class Mlp(torch.nn.Module):
    def __init__(self, widths):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(widths[i], widths[i + 1]) for i in range(len(widths) - 1))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = torch.relu(x)
        return x


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="safetensors file with x and y")
    parser.add_argument("--widths", help="layer widths, input to output (default: the data's "
                        "input width, --hidden, the data's number of classes)")
    parser.add_argument("--hidden", default="1024,1024,1024",
                        help="hidden widths when --widths is not given (default: the medium MLP's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--bf16", action="store_true",
                        help="forward and backward under torch.autocast in bf16")
    parser.add_argument("--micro-batches", type=int, default=1,
                        help="split each rank's share of a step into this many micro-batches, "
                        "accumulating gradients with engine.no_sync() (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    data = load_file(args.data)
    x, y = data["x"], data["y"]
    torch.manual_seed(args.seed)
    if args.widths:
        widths = [int(w) for w in args.widths.split(",")]
    else:
        widths = [x.shape[1]] + [int(w) for w in args.hidden.split(",")] + [int(y.max()) + 1]
    model = Mlp(widths)
    loss_fn = torch.nn.CrossEntropyLoss()

    job = shard.join()
    model.to(job.device)
    x, y = x.to(job.device), y.to(job.device)
    engine = job.wrap(model)
    for step in job.steps():
        idx = job.batch_indices(step, len(x)).to(job.device)
        parts = idx.chunk(args.micro_batches)
        loss_sum = 0.0
        for i, part in enumerate(parts):
            # Each micro-batch's share of this rank's mean loss; one reduction per step.
            with torch.autocast(job.device.type, dtype=torch.bfloat16, enabled=args.bf16):
                loss = loss_fn(model(x[part]), y[part]) * (len(part) / len(idx))
            if i + 1 < len(parts):
                with engine.no_sync():
                    loss.backward()
            else:
                loss.backward()
            loss_sum += loss.item()
        engine.step()
        job.report(loss=loss_sum)
    path = job.finish()
    if path:
        print(f"parameters written to {path}")


if __name__ == "__main__":
    main()
