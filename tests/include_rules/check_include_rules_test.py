#!/usr/bin/env python3
"""Runs check_include_rules.py on small trees: one that follows every rule (exit 0), one that
breaks each rule once (exit 1, every break named with its file:line and rule, nothing else
reported) and ones with nothing to check (exit 1), so that a checker that passes everything, or
flags what is allowed, fails here."""
import os
import subprocess
import sys
import tempfile
import unittest

CHECKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "check_include_rules.py")

# Dependencies every rule allows, the tree's own ways of including.
ALLOWED = {
    "common/plan.cc": '#include "common/plan.h"\n#include "absl/status/status.h"\n'
                      '#include "shard/config.h"\n#include <spdlog/spdlog.h>\n',
    "proto/job_convert.cc": '#include "common/job_spec.h"\n#include "shard/v1/job.pb.h"\n'
                            '#include <grpcpp/grpcpp.h>\n',
    "worker/dataplane/engine.cc": '#include "worker/dataplane/engine.h"\n#include "common/plan.h"\n'
                                  '#include <gloo/allreduce.h>\n#include "beside.h"\n'
                                  '// #include "worker/agent.h" in a comment is no include\n',
    "worker/dataplane/beside.h": "#pragma once\n",
    "worker/agent.cc": '#include "worker/dataplane/engine.h"\n#include "proto/plan_convert.h"\n'
                       '#include "worker/gpu/gpu_device.h"\n#include <grpcpp/grpcpp.h>\n',
    "worker/gpu/kernels.cu": '#include <cuda_runtime_api.h>\n#include <nccl.h>\n'
                             '#include "worker/gpu/convert.cuh"\n#include "worker/data_path.h"\n',
    "server/world_manager.cc": '#include "server/world_manager.h"\n#include "common/plan.h"\n'
                               '#include "proto/job_convert.h"\n',
    "server/coordinator_core.h": '#include "server/world_manager.h"\n'
                                 '#include "server/plan_manager.h"\n',
    "server/metrics.cc": '#include "server/plan_manager.h"\n',
    "server/world_manager_watches.cc": '#include "server/world_manager.h"\n',
    "tests/sim/simulation.cc": '#include "server/coordinator_core.h"\n'
                               '#include "server/membership_log.h"\n',
    "client/main.cc": '#include "client/status_view.h"\n#include "common/mlp_data.h"\n'
                      '#include "proto/plan_convert.h"\n#include "httplib.h"\n',
    "tests/unit/engine_test.cc": '#include "server/world_manager.h"\n#include "worker/agent.h"\n'
                                 '#include "client/status_view.h"\n',
    "tests/gpu/kernels_test.cc": "#include <cuda_runtime_api.h>\n",
    "bench/gpu_bench.cc": "#include <cublas_v2.h>\n",
}
ALLOWED_LINKS = [
    ("shard_common", "common", "absl::status", ""),
    ("shard_dataplane", "worker/dataplane", "shard_common", "common"),
    ("shard_proto", "proto", "gRPC::grpc++", ""),
    ("shardctl", "client", "shard_client", "client"),
    ("shard_gpu_objects", "worker/gpu", "CUDA::cudart_static", ""),
    ("shard_gpu", "worker/gpu", "shard_worker", "worker"),
]

# Each break once: (file, included, the rule's words that the report must hold).
BROKEN = [
    ("common/a.cc", '"proto/job_convert.h"', "common/ must not depend on proto/"),
    ("common/b.cc", '"server/world_manager.h"', "common/ must not depend on server/"),
    ("common/c.cc", '"worker/dataplane/engine.h"', "common/ must not depend on worker/"),
    ("common/d.cc", '"client/status_view.h"', "common/ must not depend on client/"),
    ("common/e.h", '"shard/v1/job.pb.h"', "common/ must not depend on generated shard/v1 code"),
    ("common/f.cc", "<grpcpp/grpcpp.h>", "common/ must not depend on gRPC/protobuf"),
    ("common/g.cc", "<google/protobuf/message.h>", "common/ must not depend on gRPC/protobuf"),
    ("common/h.cc", "<cuda_runtime_api.h>", "common/ must not depend on CUDA/NCCL"),
    ("common/i.cc", "<nccl.h>", "common/ must not depend on CUDA/NCCL"),
    ("worker/dataplane/a.cc", '"proto/plan_convert.h"',
     "worker/dataplane/ must not depend on proto/"),
    ("worker/dataplane/b.cc", '"shard/v1/coordinator.grpc.pb.h"',
     "worker/dataplane/ must not depend on generated shard/v1 code"),
    ("worker/dataplane/c.cc", "<grpc/grpc.h>",
     "worker/dataplane/ must not depend on gRPC/protobuf"),
    ("worker/dataplane/d.cc", '"server/kv_store_manager.h"',
     "worker/dataplane/ must not depend on server/"),
    ("worker/dataplane/e.cc", '"client/admin_client.h"',
     "worker/dataplane/ must not depend on client/"),
    ("worker/dataplane/f.cc", '"worker/agent.h"', "worker/dataplane/ must not depend on worker/"),
    ("worker/dataplane/g.cc", '"worker/gpu/gpu_device.h"',
     "worker/dataplane/ must not depend on worker/"),
    ("worker/dataplane/h.cc", "<cublas_v2.h>", "code outside worker/gpu/, tests/gpu/, "
     "bench/gpu_bench.cc must not depend on CUDA/NCCL"),
    ("proto/a.cc", '"server/checkpoint_manager.h"', "proto/ must not depend on server/"),
    ("proto/b.cc", '"worker/agent.h"', "proto/ must not depend on worker/"),
    ("proto/c.cc", '"client/admin_client.h"', "proto/ must not depend on client/"),
    ("server/a.cc", '"worker/dataplane/engine.h"', "server/ must not depend on worker/"),
    ("server/coordinator_service.cc", '"server/kv_store_manager.h"',
     "server/ must not depend on server/*_manager.h"),
    ("server/plan_manager.cc", '"server/world_manager.h"',
     "server/ must not depend on server/*_manager.h"),
    ("tests/sim/sim_store.cc", '"server/checkpoint_manager.h"',
     "tests/sim/ must not depend on server/*_manager.h"),
    ("server/b.cc", '"client/status_view.h"', "server/ must not depend on client/"),
    ("client/a.cc", '"server/world_manager.h"', "client/ must not depend on server/"),
    ("client/b.cc", '"worker/dataplane/trainer.h"', "client/ must not depend on worker/"),
    # A path relative to the including file counts as the file it names.
    ("client/c.cc", '"../server/world_manager.h"', "client/ must not depend on server/"),
    ("worker/a.cc", '"server/world_manager.h"', "worker/ must not depend on server/"),
    ("worker/c.cc", '"tests/support/cluster.h"', "must not depend on tests/"),
    ("common/j.cc", '"bench/harness.h"', "must not depend on bench/"),
    ("worker/b.cc", "<cuda_runtime.h>", "must not depend on CUDA/NCCL"),
    ("bench/collectives_bench.cc", "<nccl.h>", "must not depend on CUDA/NCCL"),
    ("tests/unit/a_test.cc", "<thrust/device_vector.h>", "must not depend on CUDA/NCCL"),
]
BROKEN_LINKS = [
    ("shardctl", "client", "shard_dataplane", "worker/dataplane",
     "client/ must not depend on worker/"),
    ("shard_common", "common", "gRPC::grpc++", "", "common/ must not depend on gRPC/protobuf"),
    ("shard_common", "common", "shard_proto", "proto", "common/ must not depend on proto/"),
    ("shard_dataplane", "worker/dataplane", "CUDA::cudart", "", "must not depend on CUDA/NCCL"),
    ("shard_server", "server", "shard_worker", "worker", "server/ must not depend on worker/"),
]


def write_tree(root, files):
    for path, text in files.items():
        full = os.path.join(root, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w", encoding="utf-8") as out:
            out.write(text)


def write_graph(path, edges):
    with open(path, "w", encoding="utf-8") as out:
        out.writelines("\t".join(edge) + "\n" for edge in edges)


def run_checker(root, graph):
    return subprocess.run([sys.executable, CHECKER, root, "--link-graph", graph],
                          capture_output=True, text=True, check=False)


class IncludeRulesTest(unittest.TestCase):
    def setUp(self):
        self.directory = tempfile.TemporaryDirectory()
        self.root = os.path.join(self.directory.name, "tree")
        self.graph = os.path.join(self.directory.name, "link_graph.tsv")
        write_tree(self.root, ALLOWED)
        # The server header a relative include names, and a build tree the checker must skip.
        write_tree(self.root, {"server/world_manager.h": "#pragma once\n",
                               "build/CMakeCache.txt": "",
                               "build/generated/common/x.h": "#include <grpcpp/grpcpp.h>\n"})

    def tearDown(self):
        self.directory.cleanup()

    def test_allowed_dependencies_pass(self):
        write_graph(self.graph, ALLOWED_LINKS)
        result = run_checker(self.root, self.graph)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertEqual(result.stdout.count("\n"), 1, result.stdout)

    def test_every_broken_rule_is_named(self):
        write_tree(self.root, {path: f"// line 1\n#include {included}\n"
                               for path, included, _ in BROKEN})
        write_graph(self.graph, ALLOWED_LINKS + [edge[:4] for edge in BROKEN_LINKS])
        result = run_checker(self.root, self.graph)
        self.assertEqual(result.returncode, 1, result.stdout + result.stderr)
        lines = result.stdout.splitlines()
        for path, included, rule in BROKEN:
            expected = f'{path}:2: includes "{included[1:-1]}": '
            self.assertTrue(any(line.startswith(expected) and rule in line for line in lines),
                            f"no '{expected}: ...{rule}...' in:\n{result.stdout}")
        for target, folder, item, _, rule in BROKEN_LINKS:
            expected = f"{folder}/CMakeLists.txt: target {target} links {item}: "
            self.assertTrue(any(line.startswith(expected) and rule in line for line in lines),
                            f"no '{expected}...{rule}...' in:\n{result.stdout}")
        # Nothing but the breaks: the allowed files and links are not reported.
        self.assertEqual(len(lines), len(BROKEN) + len(BROKEN_LINKS), result.stdout)

    def test_nothing_to_check_fails(self):
        empty = os.path.join(self.directory.name, "empty")
        os.makedirs(empty)
        write_graph(self.graph, ALLOWED_LINKS)
        self.assertEqual(run_checker(empty, self.graph).returncode, 1)
        write_graph(self.graph, [])
        self.assertEqual(run_checker(self.root, self.graph).returncode, 1)


if __name__ == "__main__":
    unittest.main()
