#!/usr/bin/env bash
# Builds the coordinator, shardctl and the shard Python package, and measures shard.torch against
# PyTorch's own data parallelism in one table, one run, one compute thread per process: for the
# medium MLP (Adam, global batch 256), the tiny MLP 64,64,64,10 (Adam, global batch 32: the fixed
# cost per step) and the example transformer (AdamW, global batch 32), plain torch at W=1 against
# shard.torch at W=1 (target: overhead <= 5%; the tiny MLP's: no slower), torch DDP (gloo) +
# ZeroRedundancyOptimizer at W=2 against shard.torch ZeRO-2 at W=2 (target: >= 1.2x), and the
# script's own torch.optim class through shard.torch at W=1 (engine.optimizer) against the same
# class in plain torch (target: within 10%, >= 0.91x); for the MLPs, shard-worker's built-in MLP
# of the same widths at W=1 and W=2 ("worker1", "worker2": W=2 >= 1.5x DDP + ZeRO where plain
# torch's forward+backward takes under 40 ms, >= 1.2x on slower CPUs, and >= 1.3x W=1). Every
# shard.torch and shard-worker configuration's step time over its rank's own forward+backward
# ("step/fwd+bwd", target <= 1.1 for the medium MLP and the transformer), and the transport each
# one's ranks used: shared memory (SHARD_TRANSPORT=auto, "shard2") beside TCP ("shard2tcp").
# The header names the CPU and the load average. Extra arguments go to bench/torch_bench.py (e.g.
# --steps 30 --warmup 5 --repeats 1 --models tiny --json; --configs plainopt,shard1opt for that
# last pair alone; --configs shard2,shard2tcp,shard4 adds W=4, oversubscribed on fewer than 4
# cores, and worker4 the built-in MLP's); see the Performance section of docs/torch.md.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup.sh >/dev/null
scripts/build.sh --target shard-coordinator shard-worker shardctl shard_python >/dev/null
export SHARD_BUILD_DIR="${SHARD_BUILD_DIR:-build}"
exec /usr/bin/python3 bench/torch_bench.py "$@"
