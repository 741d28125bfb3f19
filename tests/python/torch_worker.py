"""A torch worker for test_torch.py's models that have no example script (e.g. the MLP with
BatchNorm): trains make_model_and_data(config) through shard.torch.

    SHARD_COORDINATOR=... torch_worker.py --config JSON
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_torch import make_model_and_data  # noqa: E402
import shard.torch as shard  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, inputs, targets, loss_of = make_model_and_data(json.loads(args.config))
    job = shard.join()
    engine = job.wrap(model)
    for step in job.steps():
        idx = job.batch_indices(step, len(inputs))
        loss = loss_of(model(inputs[idx]), targets[idx])
        loss.backward()
        engine.step()
        job.report(loss=loss.item())
    job.finish()


if __name__ == "__main__":
    main()
