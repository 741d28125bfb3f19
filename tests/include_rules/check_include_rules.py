#!/usr/bin/env python3
"""Checks the dependency rules between Shard's folders (README's architecture tour).

    check_include_rules.py ROOT [--link-graph FILE]

Reads every #include of the C, C++ and CUDA files under ROOT (quoted and angle-bracketed; a
quoted path that exists next to the including file counts as that file) and, with
--link-graph, the direct link libraries of the product's CMake targets (the file
tests/include_rules/CMakeLists.txt writes at configure time: target, its folder, linked item,
the linked target's folder). A dependency is classified as a folder of the tree (common,
proto, server, worker, worker/dataplane, worker/gpu, client, capi, tests, bench), the generated
shard/v1 code, gRPC/protobuf, CUDA/NCCL, or anything else (allowed everywhere); RULES below say
which folder may not depend on which.

Prints one line per broken rule, naming file:line (or the target's CMakeLists.txt) and the
rule, and exits 1 if there was any (or if there was nothing to check); 0 with a summary
otherwise; 2 on a usage error.
"""
import argparse
import collections
import os
import re
import sys

FOLDERS = ("common", "proto", "server", "worker/dataplane", "worker/gpu", "worker", "client",
           "capi", "tests", "bench")
SHARD_V1 = "generated shard/v1 code"
GRPC = "gRPC/protobuf"
CUDA = "CUDA/NCCL"
# A coordinator manager's header: inside server/, and a kind of its own.
MANAGERS = "server/*_manager.h"
MANAGER_INCLUDE = re.compile(r"^server/\w+_manager\.h$")

# scope: the files (path prefixes) a rule applies to; exempt: those among them it does not;
# forbidden: kinds of dependency (a folder forbids its subfolders too); allowed: subfolders of a
# forbidden folder that stay allowed.
Rule = collections.namedtuple("Rule", "scope exempt forbidden allowed why")
RULES = (
    Rule(("server/",), ("server/coordinator_core.", "server/metrics."), (MANAGERS,), (),
         "the managers are peers that CoordinatorCore wires together; the services and the server "
         "reach them only through its handlers (the metrics read their const views)"),
    Rule(("tests/sim/",), (), (MANAGERS,), (),
         "the simulation drives the coordinator through CoordinatorCore's handlers, as the gRPC "
         "services do"),
    Rule(("common/",), (), ("proto", "server", "worker", "client", SHARD_V1, GRPC, CUDA), (),
         "common/ is pure logic shared by every part: no gRPC, no CUDA, no generated code"),
    Rule(("worker/dataplane/",), (), ("proto", SHARD_V1, GRPC, "server", "client", "worker"),
         ("worker/dataplane",),
         "the data path builds and is tested alone, without gRPC and without the worker around it"),
    Rule(("proto/",), (), ("server", "worker", "client"), (),
         "the contract and its conversions sit below the three programs"),
    Rule(("server/",), (), ("worker", "client"), (),
         "the coordinator reaches workers and shardctl only through proto/"),
    Rule(("client/",), (), ("server", "worker"), (),
         "shardctl reaches the coordinator only through proto/"),
    Rule(("worker/",), (), ("server", "client"), (),
         "the worker reaches the coordinator only through proto/"),
    Rule(("capi/",), (), ("server", "client"), (),
         "libshard is the worker as a C library: it reaches the coordinator only through proto/"),
    Rule(("common/", "proto/", "server/", "worker/", "client/", "capi/"), (), ("tests", "bench"), (),
         "the product builds without its tests and benchmarks"),
    # tests/ and bench/ may otherwise depend on anything: they test and measure the layers
    # against each other. Only the GPU code and its own tests and benchmark (built only where
    # the toolkit was found) see CUDA; everything else builds without it.
    Rule(("",), ("worker/gpu/", "tests/gpu/", "bench/gpu_bench.cc"), (CUDA,), (),
         "CUDA and NCCL stay behind worker/gpu/, so everything else builds without the toolkit"),
)

SOURCE_EXTENSIONS = (".h", ".hh", ".hpp", ".hxx", ".c", ".cc", ".cpp", ".cxx", ".cu", ".cuh",
                     ".inc")
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^">]+)[">]')
GRPC_INCLUDE = re.compile(r"^(grpc|grpcpp|grpc\+\+|google/protobuf)/")
CUDA_INCLUDE = re.compile(
    r"^(cuda|cublas|cublasLt|curand|cusparse|cusolver|cufft|nccl|nvrtc|nvml|nvToolsExt)\w*\.h$"
    r"|^(cub|thrust|cuda|nvtx3|cooperative_groups|crt)/|^cooperative_groups\.h$")
GRPC_LINK = re.compile(r"^(gRPC|protobuf)::|^(grpc|grpc\+\+|protobuf)$")
CUDA_LINK = re.compile(r"^(CUDA|NCCL)::|(^|/)(lib)?(cudart|cuda|cublas|cublasLt|nccl)"
                       r"(_static)?(\.so[.\d]*|\.a)?$")


def folder_of(path):
    """The folder of FOLDERS that holds the root-relative path, or None."""
    for folder in FOLDERS:
        if path == folder or path.startswith(folder + "/"):
            return folder
    return None


def include_kind(included):
    if MANAGER_INCLUDE.match(included):
        return MANAGERS
    if included.startswith("shard/v1/"):
        return SHARD_V1
    if GRPC_INCLUDE.match(included):
        return GRPC
    if CUDA_INCLUDE.match(included):
        return CUDA
    return folder_of(included)


def link_kind(item, item_folder):
    if item_folder:
        return folder_of(item_folder)
    if GRPC_LINK.search(item):
        return GRPC
    if CUDA_LINK.search(item):
        return CUDA
    return None


def within(kind, folder):
    return kind == folder or kind.startswith(folder + "/")


def broken_rule(path, kind):
    """The first rule (the most specific: RULES' order) that a dependency of the file or folder
    at root-relative `path` on `kind` breaks, said in words; None if it breaks none."""
    if kind is None:
        return None
    for rule in RULES:
        if not any(path.startswith(scope) for scope in rule.scope):
            continue
        if any(path.startswith(exempt) for exempt in rule.exempt):
            continue
        forbidden = next((f for f in rule.forbidden if within(kind, f)), None)
        if forbidden is None or any(within(kind, a) for a in rule.allowed):
            continue
        if rule.scope == ("",):
            scope = "code outside " + ", ".join(rule.exempt)
        else:
            scope = ", ".join(rule.scope)
        what = forbidden
        if forbidden in FOLDERS:
            inside = [a + "/" for a in rule.allowed if within(a, forbidden)]
            what = forbidden + "/" + (f" outside {', '.join(inside)}" if inside else "")
        return f"{scope} must not depend on {what} ({rule.why})"
    return None


def source_files(root):
    for directory, subdirectories, files in os.walk(root):
        # Hidden folders and build trees (in-tree builds hold generated gRPC code) are not ours.
        subdirectories[:] = sorted(
            d for d in subdirectories if not d.startswith(".")
            and not os.path.exists(os.path.join(directory, d, "CMakeCache.txt")))
        for name in sorted(files):
            if name.endswith(SOURCE_EXTENSIONS):
                yield os.path.join(directory, name)


def check_includes(root):
    problems, files, includes = [], 0, 0
    for path in source_files(root):
        relative = os.path.relpath(path, root).replace(os.sep, "/")
        files += 1
        with open(path, encoding="utf-8", errors="replace") as source:
            for number, line in enumerate(source, 1):
                match = INCLUDE.match(line)
                if not match:
                    continue
                includes += 1
                included = match.group(2)
                # "x.h" or "../server/x.h" next to the file: the file it names, from the root.
                beside = os.path.join(os.path.dirname(path), included)
                if match.group(1) == '"' and os.path.isfile(beside):
                    included = os.path.relpath(os.path.realpath(beside),
                                               os.path.realpath(root)).replace(os.sep, "/")
                # A file's own header is no dependency: world_manager.cc and the rest of the
                # class in world_manager_watches.cc on world_manager.h.
                if os.path.splitext(relative)[0].startswith(os.path.splitext(included)[0]):
                    continue
                rule = broken_rule(relative, include_kind(included))
                if rule:
                    problems.append(f'{relative}:{number}: includes "{match.group(2)}": {rule}')
    return problems, files, includes


def check_links(link_graph):
    problems, edges = [], 0
    with open(link_graph, encoding="utf-8") as graph:
        for line in graph:
            if not line.strip():
                continue
            target, folder, item, item_folder = line.rstrip("\n").split("\t")
            edges += 1
            rule = broken_rule(folder + "/", link_kind(item, item_folder))
            if rule:
                problems.append(f"{folder}/CMakeLists.txt: target {target} links {item}: {rule}")
    return problems, edges


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", help="the source tree")
    parser.add_argument("--link-graph", help="the product targets' links (from CMake)")
    args = parser.parse_args()
    if not os.path.isdir(args.root):
        parser.error(f"no folder {args.root}")
    if args.link_graph and not os.path.isfile(args.link_graph):
        parser.error(f"no file {args.link_graph}")
    problems, files, includes = check_includes(args.root)
    edges = 0
    if args.link_graph:
        link_problems, edges = check_links(args.link_graph)
        problems += link_problems
    # Nothing checked must not read as everything allowed.
    if includes == 0 or (args.link_graph and edges == 0):
        print(f"include_rules: no #include under {args.root} or no link in {args.link_graph}: "
              "is that the source tree and the graph CMake wrote?", file=sys.stderr)
        return 1
    for problem in problems:
        print(problem)
    if problems:
        print(f"include_rules: {len(problems)} dependencies break the rules", file=sys.stderr)
        return 1
    print(f"include_rules: {includes} includes in {files} files and {edges} link edges "
          "follow the rules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
