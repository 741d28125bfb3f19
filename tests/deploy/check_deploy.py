#!/usr/bin/env python3
"""Offline validation of Shard's deployment files (deploy/): the checks a typo or a stale flag
would break, run against the real binaries' --help.

    check_deploy.py BIN_DIR [REPO_ROOT]

- every YAML file parses, every JSON file parses, and the job specs use only JobSpec fields
  (proto/shard/v1/job.proto; the coordinator rejects unknown fields);
- the kustomize base renders (`kubectl kustomize`, when kubectl exists) and
  `docker compose config` accepts the compose files (when a compose plugin exists);
- every command line in the compose file, the Kubernetes manifests and the Dockerfiles names a
  binary the image really carries, and every flag on it exists in that binary's --help
  (subcommands included);
- every SHARD_* environment variable is SHARD_ + a flag of the container's binary, upper-cased,
  '-' -> '_' (and every "(Env:...)" the binaries print follows that convention);
- the flags of the deployment contract exist (deploy/README.md documents them);
- probes and health checks hit the coordinator's --health-listen port, the Service and the
  workers' coordinator address hit its --listen port, worker counts equal the job's worldSize,
  the job's data, output and checkpoint paths and the state directory lie on the volume shared by
  the coordinator and every worker, and the Docker build context keeps what the build reads.

Prints one line per problem and exits 1 if there was any; 0 with a summary otherwise.
"""
import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

try:
    import yaml
except ImportError:  # pragma: no cover
    print("check_deploy: python3 'yaml' module missing (Debian: python3-yaml)")
    sys.exit(1)

BINARIES = ("shard-coordinator", "shard-worker", "shardctl")
# The flags the deployment files and deploy/README.md rely on (issue 8's contract).
CONTRACT = {
    "shard-coordinator": ["--listen", "--state-dir", "--job", "--restore", "--lease",
                          "--reform-grace", "--health-listen", "--metrics-listen", "--tls-cert",
                          "--tls-key", "--tls-client-ca", "--job-token-file",
                          "--admin-token-file", "--log-level"],
    "shard-worker": ["--coordinator", "--id", "--device", "--tls-ca", "--tls-cert", "--tls-key",
                     "--tls-server-name", "--job-token-file", "--log-level"],
    "shardctl": ["--coordinator", "--tls-ca", "--tls-cert", "--tls-key", "--tls-server-name",
                 "--admin-token-file"],
}
# Scripts the images carry besides the binaries (deploy/docker/).
HELPERS = ("shard-healthcheck",)
SHELLS = ("sh", "bash", "/bin/sh", "/bin/bash")

errors = {}    # message -> [where, ...]: the same problem in many services is one line
warnings = {}
checked = {"yaml": 0, "json": 0, "commands": 0, "flags": 0, "env": 0}


def error(where, message):
    errors.setdefault(message, []).append(where)


def warn(where, message):
    warnings.setdefault(message, []).append(where)


def report(kind, problems):
    for message, wheres in problems.items():
        shown = ", ".join(wheres[:3]) + (f" and {len(wheres) - 3} more" if len(wheres) > 3 else "")
        print(f"check_deploy: {kind}: {message} [{shown}]")


def env_name(flag):
    return "SHARD_" + flag[2:].upper().replace("-", "_")


def flag_of_env(name):
    return "--" + name[len("SHARD_"):].lower().replace("_", "-")


# --- binaries' --help -----------------------------------------------------------------------
class Help:
    """Options and subcommands of one (sub)command, parsed from CLI11's --help."""
    OPTION = re.compile(r"^  (?:-\w,)?(--[A-Za-z0-9][A-Za-z0-9-]*)(.*)$")
    TYPE = re.compile(r"^[A-Z][A-Z0-9_]*(?:[:=\[]|$)")

    def __init__(self, text):
        self.options = {}   # --flag -> {"value": bool, "env": str|None}
        self.subcommands = set()
        section = None
        for line in text.splitlines():
            if re.match(r"^\S.*:\s*$", line):
                section = line.strip().rstrip(":").lower()
                continue
            match = self.OPTION.match(line)
            if match:
                rest = match.group(2).split()
                env = re.search(r"\(Env:([^)]+)\)", line)
                self.options[match.group(1)] = {
                    "value": bool(rest) and bool(self.TYPE.match(rest[0])),
                    "env": env.group(1) if env else None,
                }
                continue
            if section == "subcommands":
                sub = re.match(r"^  ([A-Za-z0-9][A-Za-z0-9_-]*)(\s|$)", line)
                if sub:
                    self.subcommands.add(sub.group(1))


_help_cache = {}


def help_of(bin_dir, path):
    """Help of the command path (binary, subcommand, ...), or None if it cannot be run."""
    path = tuple(path)
    if path not in _help_cache:
        binary = os.path.join(bin_dir, path[0])
        try:
            result = subprocess.run([binary, *path[1:], "--help"], capture_output=True,
                                    text=True, timeout=20)
            _help_cache[path] = Help(result.stdout + result.stderr) if result.returncode == 0 \
                else None
        except (OSError, subprocess.TimeoutExpired):
            _help_cache[path] = None
    return _help_cache[path]


def check_flags(bin_dir, where, argv):
    """Checks argv = [binary, args...] against the binary's --help, subcommands included."""
    binary = os.path.basename(argv[0])
    checked["commands"] += 1
    path = [binary]
    contexts = [help_of(bin_dir, path)]
    tokens = list(argv[1:])
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if token == "--":
            break
        if token.startswith("--"):
            flag, has_inline_value = token.split("=", 1)[0], "=" in token
            option = next((c.options[flag] for c in reversed(contexts) if flag in c.options),
                          None)
            checked["flags"] += 1
            if option is None:
                error(where, f"flag {flag} is not an option of `{' '.join(path)}` "
                             f"(not in its --help)")
                # Unknown arity: assume a value follows unless the next token is a flag.
                if not has_inline_value and i < len(tokens) and not tokens[i].startswith("-"):
                    i += 1
                continue
            if option["value"] and not has_inline_value:
                if i >= len(tokens):
                    error(where, f"flag {flag} of {binary} needs a value")
                i += 1
            continue
        if token.startswith("-") and len(token) > 1:
            continue  # short flags (-h) are not used in the deployment files
        if token in contexts[-1].subcommands:
            path.append(token)
            sub = help_of(bin_dir, path)
            if sub is None:
                error(where, f"`{' '.join(path)} --help` failed")
                return
            contexts.append(sub)
    return path


def shell_commands(script):
    """Simple commands of a shell script, split at ; && || | { } ( )."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=";&|(){}")
    lexer.whitespace_split = True
    commands, current = [], []
    for token in lexer:
        if token and set(token) <= set(";&|(){}"):
            if current:
                commands.append(current)
            current = []
        else:
            current.append(token)
    if current:
        commands.append(current)
    return [c[1:] if c and c[0] in ("exec", "!") else c for c in commands]


def invoked_binaries(bin_dir, where, argv, image_programs):
    """Checks a container's full command line; returns the Shard binaries it runs."""
    if not argv:
        error(where, "no command (and the image has no ENTRYPOINT/CMD)")
        return []
    program = os.path.basename(argv[0])
    if argv[0] in SHELLS and len(argv) >= 3 and argv[1] == "-c":
        ran = []
        for command in shell_commands(argv[2]):
            if command and os.path.basename(command[0]) in BINARIES:
                if os.path.basename(command[0]) not in image_programs:
                    error(where, f"runs {command[0]}, which the image does not carry "
                                 f"(image has {sorted(image_programs)})")
                check_flags(bin_dir, where, command)
                ran.append(os.path.basename(command[0]))
        if not ran:
            error(where, "the shell command runs no Shard binary")
        return ran
    if program not in image_programs:
        error(where, f"command '{argv[0]}' is not a program the image carries "
                     f"({sorted(image_programs)})")
        return []
    if program in BINARIES:
        check_flags(bin_dir, where, [program, *argv[1:]])
        return [program]
    return []


def check_env(bin_dir, where, env, binaries):
    for name in env:
        checked["env"] += 1
        if not re.fullmatch(r"[A-Z_][A-Z0-9_]*", name):
            error(where, f"environment variable '{name}' is not an upper-case identifier")
            continue
        if name.startswith("SHARD") and not name.startswith("SHARD_"):
            error(where, f"environment variable '{name}' looks like Shard's but lacks 'SHARD_'")
            continue
        if not name.startswith("SHARD_") or not binaries:
            continue
        flag = flag_of_env(name)
        owners = [b for b in binaries if flag in help_of(bin_dir, [b]).options]
        if not owners:
            error(where, f"environment variable {name} matches no flag of {'/'.join(binaries)} "
                         f"(expected {flag} in --help; convention SHARD_ + flag upper-cased, "
                         f"'-' -> '_')")
            continue
        for owner in owners:
            shown = help_of(bin_dir, [owner]).options[flag]["env"]
            if shown is None:
                warn(where, f"{owner} --help shows no environment variable for {flag} "
                            f"(expected '(Env:{name})'); is {name} read?")


def argument_value(argv, env, flag):
    """The value a binary gets for --flag: the command line wins over SHARD_<FLAG>."""
    for i, token in enumerate(argv):
        if token == flag and i + 1 < len(argv):
            return argv[i + 1]
        if token.startswith(flag + "="):
            return token.split("=", 1)[1]
    value = env.get(env_name(flag))
    return value if isinstance(value, str) else None


def port_of(address):
    if not address or ":" not in address:
        return None
    port = address.rsplit(":", 1)[1]
    return int(port) if port.isdigit() else None


def under(path, mounts):
    return any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounts)


# --- job specs --------------------------------------------------------------------------------
def proto_messages(proto_file):
    """message name -> {field json names and snake names: type}, from job.proto."""
    text = open(proto_file).read()
    messages = {}
    for match in re.finditer(r"message\s+(\w+)\s*\{(.*?)\n\}", text, re.S):
        fields = {}
        for field in re.finditer(r"^\s*(?:optional\s+|repeated\s+)?(\w+)\s+(\w+)\s*=\s*\d+",
                                 match.group(2), re.M):
            kind, name = field.groups()
            camel = re.sub(r"_([a-z0-9])", lambda m: m.group(1).upper(), name)
            fields[name] = kind
            fields[camel] = kind
        messages[match.group(1)] = fields
    return messages


def check_job_spec(where, spec, messages, message="JobSpec"):
    if not isinstance(spec, dict):
        return
    fields = messages.get(message, {})
    for key, value in spec.items():
        if key not in fields:
            error(where, f"job spec field '{key}' is not a field of shard.v1.{message}")
        elif fields[key] in messages:
            check_job_spec(where, value, messages, fields[key])


def job_paths(spec):
    checkpoint = (spec.get("checkpoint") or {}).get("dir")
    output = spec.get("outputDir") or spec.get("output_dir")
    paths = {"data.path": (spec.get("data") or {}).get("path"), "outputDir": output,
             "checkpoint.dir": checkpoint or (output and output.rstrip("/") + "/checkpoints")}
    return {k: v for k, v in paths.items() if v}


def world_size(spec):
    return spec.get("worldSize", spec.get("world_size"))


# --- Dockerfiles ------------------------------------------------------------------------------
class Dockerfile:
    def __init__(self, path, root):
        self.path = path
        self.name = os.path.relpath(path, root)
        text = open(path).read().replace("\\\n", " ")
        self.lines = [l.strip() for l in text.splitlines() if l.strip() and
                      not l.strip().startswith("#")]
        self.entrypoint, self.cmd, self.healthcheck = [], [], None
        self.copies = []  # context sources of COPY without --from
        self.programs = set()
        for line in self.lines:
            keyword, _, rest = line.partition(" ")
            keyword = keyword.upper()
            if keyword in ("ENTRYPOINT", "CMD"):
                try:
                    value = json.loads(rest)
                except ValueError:
                    error(self.name, f"{keyword} must use the JSON (exec) form, got: {rest}")
                    value = []
                if keyword == "ENTRYPOINT":
                    self.entrypoint = value
                else:
                    self.cmd = value
            elif keyword == "HEALTHCHECK":
                self.healthcheck = rest
            elif keyword == "COPY" and "--from=" not in rest:
                parts = [p for p in rest.split() if not p.startswith("--")]
                self.copies.extend(parts[:-1])
            elif keyword == "RUN":
                # Programs staged for the runtime image: cp ... /out/bin/
                for cp in re.finditer(r"cp\s+([^&;]*?)\s+/out/bin/?(?=\s|$)", rest):
                    for source in cp.group(1).split():
                        self.programs.add(os.path.basename(source))
        if not any(l.upper().startswith("USER ") for l in self.lines):
            error(self.name, "the image has no USER (it must not run as root)")
        elif any(re.match(r"(?i)^USER\s+(root|0)(:|\s|$)", l) for l in self.lines[-10:]):
            error(self.name, "the runtime stage runs as root")

    def default_argv(self):
        return self.entrypoint + self.cmd


def check_dockerfile(bin_dir, root, dockerfile):
    where = dockerfile.name
    for program in dockerfile.programs:
        if program in HELPERS:
            if not os.path.isfile(os.path.join(root, "deploy", "docker", program)):
                error(where, f"helper {program} does not exist in deploy/docker/")
        elif program not in BINARIES:
            error(where, f"copies '{program}', which is not one of Shard's binaries {BINARIES}")
        elif not os.access(os.path.join(bin_dir, program), os.X_OK):
            error(where, f"copies {program}, which is not in the build's bin dir {bin_dir}")
    if not dockerfile.programs:
        error(where, "stages no binaries for the runtime image (cp ... /out/bin/)")
    for line in dockerfile.lines:
        if re.search(r"SHARD_WITH_CUDA=(\w+)", line) and "cpu" in where:
            if "SHARD_WITH_CUDA=OFF" not in line:
                error(where, "the CPU image must build with -DSHARD_WITH_CUDA=OFF")
    argv = dockerfile.default_argv()
    if argv:
        invoked_binaries(bin_dir, f"{where} ENTRYPOINT/CMD", argv, dockerfile.programs)
    if not any(l.upper().startswith("VOLUME") and "/var/lib/shard" in l for l in dockerfile.lines):
        error(where, "declares no VOLUME /var/lib/shard")
    # The build context: every COPY source and every folder the top-level CMakeLists.txt adds
    # must survive <Dockerfile>.dockerignore.
    ignore_file = dockerfile.path + ".dockerignore"
    if not os.path.isfile(ignore_file):
        error(where, f"has no {os.path.basename(ignore_file)} (the build context would carry "
                     f"build trees and .git)")
        return
    patterns = [l.strip() for l in open(ignore_file) if l.strip() and not l.startswith("#")]

    def excluded(path):
        result = False
        for pattern in patterns:
            negate = pattern.startswith("!")
            pattern = pattern.lstrip("!").strip("/")
            parts = path.split("/")
            prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
            if any(fnmatch.fnmatch(p, pattern) or fnmatch.fnmatch(p, pattern.replace("**/", ""))
                   for p in prefixes):
                result = not negate
        return result

    for source in dockerfile.copies:
        if source == ".":
            continue
        if not os.path.exists(os.path.join(root, source)):
            error(where, f"COPY {source}: no such file in the repository")
        elif excluded(source):
            error(where, f"COPY {source}: excluded by {os.path.basename(ignore_file)}")
    cmake = open(os.path.join(root, "CMakeLists.txt")).read()
    for sub in re.findall(r"add_subdirectory\(\s*([\w/.-]+)", cmake):
        if sub.startswith("tests"):
            continue  # the images build with -DBUILD_TESTING=OFF
        if excluded(sub):
            error(where, f"{os.path.basename(ignore_file)} excludes {sub}/, which the build "
                         f"adds (CMakeLists.txt add_subdirectory)")
    for needed in ("scripts/setup.sh", "deploy/docker/runtime-packages.sh"):
        if excluded(needed):
            error(where, f"{os.path.basename(ignore_file)} excludes {needed}")


# --- compose ----------------------------------------------------------------------------------
def interpolate(value):
    """Compose's ${VAR:-default} / ${VAR-default} / ${VAR} with an empty environment."""
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if not isinstance(value, str):
        return value
    return re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}", lambda m: m.group(2) or "", value)


def compose_env(service):
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(e.split("=", 1) if "=" in e else (e, "") for e in env)
    return {k: interpolate(str(v)) if v is not None else "" for k, v in env.items()}


def merge_services(base, override):
    merged = {name: dict(service) for name, service in base.items()}
    for name, service in (override or {}).items():
        target = merged.setdefault(name, {})
        for key, value in service.items():
            if key == "environment":
                env = dict(compose_env(target))
                env.update(compose_env(service))
                target["environment"] = env
            elif isinstance(value, list) and isinstance(target.get(key), list):
                target[key] = target[key] + value
            else:
                target[key] = value
    return merged


def check_compose(bin_dir, root, dockerfiles, messages):
    deploy = os.path.join(root, "deploy")
    base_file = os.path.join(deploy, "docker-compose.yml")
    if not os.path.isfile(base_file):
        error("deploy", "docker-compose.yml is missing")
        return
    base = yaml.safe_load(open(base_file))
    variants = {"docker-compose.yml": base.get("services", {})}
    for extra in sorted(os.listdir(deploy)):
        if extra.startswith("docker-compose.") and extra != "docker-compose.yml" and \
                extra.endswith((".yml", ".yaml")):
            override = yaml.safe_load(open(os.path.join(deploy, extra))) or {}
            variants[f"docker-compose.yml + {extra}"] = merge_services(
                base.get("services", {}), override.get("services"))
            for name in (override.get("services") or {}):
                if name not in base.get("services", {}):
                    error(extra, f"service '{name}' is not in docker-compose.yml")
            for name, secret in (override.get("secrets") or {}).items():
                if "file" not in secret:
                    error(extra, f"secret {name} has no file")
    # image name -> Dockerfile, from the services that build it
    image_files = {}
    for service in base.get("services", {}).values():
        build = service.get("build")
        if isinstance(build, dict) and service.get("image"):
            path = os.path.normpath(os.path.join(deploy, build.get("context", "."),
                                                 build.get("dockerfile", "Dockerfile")))
            if path not in dockerfiles:
                error("docker-compose.yml", f"builds {path}, which is not a Dockerfile here")
            else:
                image_files[service["image"]] = dockerfiles[path]

    for variant, services in variants.items():
        coordinator, workers = None, []
        for name, service in services.items():
            where = f"{variant} service {name}"
            image = service.get("image")
            dockerfile = image_files.get(image)
            if dockerfile is None:
                error(where, f"image '{image}' is built by no service of the compose file")
                continue
            command = interpolate(service.get("command"))
            if isinstance(command, str):
                command = shlex.split(command)
            entrypoint = interpolate(service.get("entrypoint"))
            if isinstance(entrypoint, str):
                entrypoint = shlex.split(entrypoint)
            if entrypoint is None:
                entrypoint = dockerfile.entrypoint
            argv = entrypoint + (command if command is not None else dockerfile.cmd)
            env = compose_env(service)
            ran = invoked_binaries(bin_dir, where, argv, dockerfile.programs)
            check_env(bin_dir, where, env, ran)
            info = {"name": name, "service": service, "argv": argv, "env": env,
                    "mounts": compose_mounts(service)}
            if "shard-coordinator" in ran:
                coordinator = info
            if "shard-worker" in ran:
                workers.append(info)
        if coordinator is None:
            error(variant, "no service runs shard-coordinator")
            continue
        check_compose_coordinator(variant, coordinator, workers, deploy, messages)


def compose_mounts(service):
    mounts = {}
    for volume in service.get("volumes") or []:
        if isinstance(volume, str):
            parts = volume.split(":")
            if len(parts) >= 2:
                mounts[parts[1]] = parts[0]
        elif isinstance(volume, dict):
            mounts[volume.get("target")] = volume.get("source")
    return mounts  # container path -> source


def check_compose_coordinator(variant, coordinator, workers, deploy, messages):
    argv, env = coordinator["argv"], coordinator["env"]
    where = f"{variant} service {coordinator['name']}"
    listen = argument_value(argv, env, "--listen")
    health = argument_value(argv, env, "--health-listen")
    if port_of(listen) is None:
        error(where, f"--listen must be HOST:PORT, got {listen!r}")
    if port_of(health) is None:
        error(where, f"--health-listen must be HOST:PORT, got {health!r}")
    test = coordinator["service"].get("healthcheck", {}).get("test")
    if not test:
        error(where, "has no healthcheck")
    else:
        text = " ".join(test) if isinstance(test, list) else test
        probe_port = port_of((re.findall(r"\S+:\d+", text) or [None])[-1])
        if "shard-healthcheck" not in text:
            error(where, f"healthcheck does not use shard-healthcheck: {text}")
        if probe_port is not None and probe_port != port_of(health):
            error(where, f"healthcheck probes port {probe_port}, but --health-listen is {health}")
    state_dir = argument_value(argv, env, "--state-dir")
    shared = {path: source for path, source in coordinator["mounts"].items()
              if not source.startswith(".")}
    if not state_dir or not under(state_dir, shared):
        error(where, f"--state-dir {state_dir!r} is not on a named volume {sorted(shared)}")
    # The job spec the coordinator reads, through its bind mount.
    job = argument_value(argv, env, "--job")
    spec = None
    if job:
        source = coordinator["mounts"].get(job)
        if source is None:
            error(where, f"--job {job} is not a file mounted into the container")
        else:
            spec_file = os.path.normpath(os.path.join(deploy, source))
            spec = json.load(open(spec_file))
    active = [w for w in workers if not w["service"].get("profiles")]
    if "gpu" in json.dumps(job or ""):
        active = [w for w in workers if "gpu" in (w["service"].get("profiles") or [])]
    if spec is not None:
        if world_size(spec) != len(active):
            error(where, f"job spec {os.path.basename(job)} has worldSize {world_size(spec)} "
                         f"but {len(active)} worker services run with it")
        for field, path in job_paths(spec).items():
            for user in [coordinator] + workers:
                volumes = {p: s for p, s in user["mounts"].items() if not s.startswith(".")}
                if not under(path, volumes):
                    error(f"{variant} service {user['name']}",
                          f"job spec {field} {path} is not on the shared volume it mounts "
                          f"{sorted(volumes)}")
    # Other job specs mounted for other profiles: check their world size too.
    for path, source in coordinator["mounts"].items():
        if path.endswith(".json") and path != job and source.startswith("."):
            other = json.load(open(os.path.normpath(os.path.join(deploy, source))))
            profile_workers = [w for w in workers if "gpu" in (w["service"].get("profiles") or [])]
            if "gpu" in path and world_size(other) != len(profile_workers):
                error(where, f"{source} has worldSize {world_size(other)} but the gpu profile "
                             f"has {len(profile_workers)} workers")
    for worker in workers:
        wwhere = f"{variant} service {worker['name']}"
        address = argument_value(worker["argv"], worker["env"], "--coordinator")
        host = address.rsplit(":", 1)[0] if address else None
        if host != coordinator["name"] or port_of(address) != port_of(listen):
            error(wwhere, f"--coordinator {address!r} is not {coordinator['name']}:"
                          f"{port_of(listen)} (the coordinator's --listen)")
        worker_host = argument_value(worker["argv"], worker["env"], "--host")
        if worker_host in (None, "127.0.0.1", "localhost"):
            error(wwhere, "sets no --host its peers can reach (default 127.0.0.1)")
        elif worker_host != worker["service"].get("hostname"):
            error(wwhere, f"--host {worker_host} is not the container's hostname "
                          f"{worker['service'].get('hostname')!r}")
        if "gpu" in (worker["service"].get("profiles") or []):
            devices = (((worker["service"].get("deploy") or {}).get("resources") or {})
                       .get("reservations") or {}).get("devices")
            if not devices:
                error(wwhere, "a gpu-profile worker reserves no GPU (deploy.resources."
                              "reservations.devices)")
    ids = [argument_value(w["argv"], w["env"], "--id") for w in workers]
    if len(set(ids)) != len(ids) or None in ids:
        error(variant, f"worker ids are not unique and explicit: {ids}")


# --- Kubernetes -------------------------------------------------------------------------------
def load_kustomize(root):
    base = os.path.join(root, "deploy", "k8s")
    kubectl = shutil.which("kubectl")
    if kubectl:
        result = subprocess.run([kubectl, "kustomize", base], capture_output=True, text=True,
                                timeout=120)
        if result.returncode != 0:
            error("deploy/k8s", f"kubectl kustomize failed: {result.stderr.strip()}")
            return None
        print("check_deploy: kubectl kustomize deploy/k8s rendered "
              f"{len(list(yaml.safe_load_all(result.stdout)))} objects")
        return [d for d in yaml.safe_load_all(result.stdout) if d]
    print("check_deploy: SKIPPED rendering with kubectl kustomize (kubectl not installed); "
          "checking the raw resources instead")
    kustomization = yaml.safe_load(open(os.path.join(base, "kustomization.yaml")))
    docs = []
    for resource in kustomization.get("resources", []):
        docs.extend(d for d in yaml.safe_load_all(open(os.path.join(base, resource))) if d)
    for generator in kustomization.get("configMapGenerator", []):
        data = {}
        for entry in generator.get("files", []):
            key, _, path = entry.partition("=")
            data[key if path else os.path.basename(key)] = open(
                os.path.join(base, path or key)).read()
        docs.append({"kind": "ConfigMap", "metadata": {"name": generator["name"]},
                     "data": data})
    return docs


def check_k8s(bin_dir, root, dockerfiles, messages):
    docs = load_kustomize(root)
    if docs is None:
        return
    by_kind = {}
    for doc in docs:
        by_kind.setdefault(doc.get("kind"), []).append(doc)
    images = {}
    for path, dockerfile in dockerfiles.items():
        tag = os.path.basename(path).split(".")[0]  # cpu.Dockerfile -> shard:cpu
        images[f"shard:{tag}"] = dockerfile
    configmaps = {c["metadata"]["name"]: c for c in by_kind.get("ConfigMap", [])}
    secrets = {s["metadata"]["name"]: s for s in by_kind.get("Secret", [])}
    services = by_kind.get("Service", [])
    pvcs = {p["metadata"]["name"]: p for p in by_kind.get("PersistentVolumeClaim", [])}
    for name, pvc in pvcs.items():
        if "ReadWriteMany" not in pvc["spec"].get("accessModes", []):
            error(f"PersistentVolumeClaim {name}", "must be ReadWriteMany (every worker writes "
                                                   "checkpoint shards)")
    coordinator, workers = None, []
    for kind in ("Deployment", "StatefulSet", "Job", "Pod"):
        for workload in by_kind.get(kind, []):
            spec = workload["spec"] if kind == "Pod" else workload["spec"]["template"]["spec"]
            wname = f"{kind} {workload['metadata']['name']}"
            volumes = {v["name"]: v for v in spec.get("volumes", [])}
            pod_security = spec.get("securityContext") or {}
            for container in spec.get("initContainers", []) + spec.get("containers", []):
                where = f"{wname} container {container['name']}"
                image = container.get("image", "")
                base_image = image.split("/")[-1]
                dockerfile = images.get(base_image)
                if dockerfile is None:
                    error(where, f"image '{image}' is none of ours {sorted(images)}")
                    continue
                command = container.get("command")
                args = container.get("args")
                if command is not None:
                    argv = command + (args or [])
                else:
                    argv = dockerfile.entrypoint + (args if args is not None else dockerfile.cmd)
                env, env_sources = {}, {}
                for entry in container.get("env", []):
                    env[entry["name"]] = entry.get("value")
                    env_sources[entry["name"]] = entry
                ran = invoked_binaries(bin_dir, where, argv, dockerfile.programs)
                check_env(bin_dir, where, env, ran)
                security = container.get("securityContext") or {}
                if not (security.get("runAsNonRoot") or pod_security.get("runAsNonRoot")):
                    error(where, "does not set runAsNonRoot")
                if not security.get("readOnlyRootFilesystem"):
                    error(where, "does not set readOnlyRootFilesystem")
                mounts = {}
                for mount in container.get("volumeMounts", []):
                    volume = volumes.get(mount["name"])
                    if volume is None:
                        error(where, f"mounts volume {mount['name']}, which the pod lacks")
                        continue
                    mounts[mount["mountPath"]] = volume
                    if "configMap" in volume:
                        cm = volume["configMap"]["name"]
                        if cm not in configmaps:
                            error(where, f"ConfigMap {cm} does not exist")
                    if "secret" in volume:
                        secret = secrets.get(volume["secret"]["secretName"])
                        if secret is None:
                            error(where, f"Secret {volume['secret']['secretName']} does not exist")
                        else:
                            keys = set(secret.get("stringData", {})) | set(secret.get("data", {}))
                            for item in volume["secret"].get("items", []):
                                if item["key"] not in keys:
                                    error(where, f"Secret key {item['key']} does not exist")
                # Files given through flags must be on a mounted volume.
                for name, value in env.items():
                    if name.startswith("SHARD_") and name.endswith(("_FILE", "_CERT", "_KEY",
                                                                     "_CA")) and value:
                        if not under(value, mounts):
                            error(where, f"{name}={value} is on no mounted volume")
                        else:
                            mount = max((m for m in mounts if under(value, [m])), key=len)
                            volume = mounts[mount]
                            if "secret" in volume and volume["secret"].get("items"):
                                relative = os.path.relpath(value, mount)
                                paths = [i["path"] for i in volume["secret"]["items"]]
                                if relative not in paths:
                                    error(where, f"{name}={value}: the Secret volume projects "
                                                 f"only {paths}")
                info = {"where": where, "workload": workload, "kind": kind,
                        "container": container, "argv": argv, "env": env,
                        "env_sources": env_sources, "mounts": mounts}
                if "shard-coordinator" in ran and container in spec.get("containers", []):
                    coordinator = info
                if "shard-worker" in ran:
                    workers.append(info)
    if coordinator is None:
        error("deploy/k8s", "no container runs shard-coordinator")
        return
    check_k8s_coordinator(coordinator, workers, services, configmaps, messages, by_kind)


def pvc_mounts(info):
    return {path: volume["persistentVolumeClaim"]["claimName"]
            for path, volume in info["mounts"].items() if "persistentVolumeClaim" in volume}


def check_k8s_coordinator(coordinator, workers, services, configmaps, messages, by_kind):
    where = coordinator["where"]
    container, argv, env = coordinator["container"], coordinator["argv"], coordinator["env"]
    workload = coordinator["workload"]
    if coordinator["kind"] == "Deployment":
        if workload["spec"].get("replicas", 1) != 1:
            error(where, "the coordinator Deployment must have exactly 1 replica")
        if (workload["spec"].get("strategy") or {}).get("type") != "Recreate":
            error(where, "the coordinator Deployment must use strategy Recreate (one coordinator "
                         "per state directory)")
    listen = argument_value(argv, env, "--listen")
    health = argument_value(argv, env, "--health-listen")
    metrics = argument_value(argv, env, "--metrics-listen")
    ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}

    def resolve(port):
        return ports.get(port) if isinstance(port, str) else port

    for probe_kind in ("readinessProbe", "livenessProbe", "startupProbe"):
        probe = container.get(probe_kind)
        if probe is None:
            if probe_kind != "startupProbe":
                error(where, f"has no {probe_kind}")
            continue
        if "grpc" not in probe:
            error(where, f"{probe_kind} is not a native gRPC probe")
            continue
        if resolve(probe["grpc"].get("port")) != port_of(health):
            error(where, f"{probe_kind} probes port {probe['grpc'].get('port')}, but "
                         f"--health-listen is {health}")
    for flag, address in (("--listen", listen), ("--health-listen", health),
                          ("--metrics-listen", metrics)):
        if port_of(address) is None:
            error(where, f"{flag} must be HOST:PORT, got {address!r}")
        elif port_of(address) not in ports.values():
            error(where, f"{flag} port {port_of(address)} is not a containerPort {ports}")
    annotations = workload["spec"]["template"]["metadata"].get("annotations", {})
    if annotations.get("prometheus.io/port") not in (None, str(port_of(metrics))):
        error(where, f"prometheus.io/port {annotations.get('prometheus.io/port')} is not the "
                     f"--metrics-listen port {port_of(metrics)}")
    labels = workload["spec"]["template"]["metadata"].get("labels", {})
    service_ports = {}
    for service in services:
        selector = service["spec"].get("selector", {})
        if selector and all(labels.get(k) == v for k, v in selector.items()):
            for port in service["spec"]["ports"]:
                service_ports[(service["metadata"]["name"], port["port"])] = resolve(
                    port.get("targetPort", port["port"]))
    if not service_ports:
        error(where, "no Service selects the coordinator")
    # State and the job spec.
    shared = pvc_mounts(coordinator)
    state_dir = argument_value(argv, env, "--state-dir")
    if not state_dir or not under(state_dir, shared):
        error(where, f"--state-dir {state_dir!r} is not on a PersistentVolumeClaim {shared}")
    job = argument_value(argv, env, "--job")
    spec = None
    if not job:
        error(where, "the coordinator gets no --job")
    else:
        mount = max((m for m in coordinator["mounts"] if under(job, [m])), key=len, default=None)
        volume = coordinator["mounts"].get(mount) if mount else None
        if volume is None or "configMap" not in volume:
            error(where, f"--job {job} is not in a mounted ConfigMap")
        else:
            data = configmaps.get(volume["configMap"]["name"], {}).get("data", {})
            key = os.path.relpath(job, mount)
            if key not in data:
                error(where, f"--job {job}: the ConfigMap has no key {key}")
            else:
                spec = json.loads(data[key])
                check_job_spec(f"{where} ConfigMap key {key}", spec, messages)
    if spec is not None:
        for field, path in job_paths(spec).items():
            for user in [coordinator] + workers:
                if not under(path, pvc_mounts(user)):
                    error(user["where"], f"job spec {field} {path} is not on the shared "
                                         f"PersistentVolumeClaim {pvc_mounts(user)}")
        claims = {c for user in [coordinator] + workers for c in pvc_mounts(user).values()}
        if len(claims) > 1:
            error("deploy/k8s", f"coordinator and workers mount different claims {claims}")
    # Workers.
    if not workers:
        error("deploy/k8s", "no container runs shard-worker")
    for worker in workers:
        wwhere = worker["where"]
        workload = worker["workload"]
        if worker["kind"] == "Job":
            job_spec = workload["spec"]
            if job_spec.get("completionMode") != "Indexed":
                error(wwhere, "the workers Job must be completionMode: Indexed")
            if spec is not None and not (job_spec.get("completions") == job_spec.get(
                    "parallelism") == world_size(spec)):
                error(wwhere, f"completions {job_spec.get('completions')} and parallelism "
                              f"{job_spec.get('parallelism')} must equal the job spec's "
                              f"worldSize {world_size(spec)}")
            worker_id = argument_value(worker["argv"], worker["env"], "--id") or ""
            index_vars = [n for n, e in worker["env_sources"].items() if "job-completion-index" in
                          json.dumps(e.get("valueFrom", {}))] + ["JOB_COMPLETION_INDEX"]
            if not any(f"$({v})" in worker_id for v in index_vars):
                error(wwhere, f"--id {worker_id!r} is not derived from the completion index")
        limits = (worker["container"].get("resources") or {}).get("limits") or {}
        device = argument_value(worker["argv"], worker["env"], "--device") or "cpu"
        if device.startswith("cuda") and str(limits.get("nvidia.com/gpu")) != "1":
            error(wwhere, f"a {device} worker must request nvidia.com/gpu: 1 (limits)")
        if not (worker["container"].get("resources") or {}).get("requests"):
            error(wwhere, "has no resource requests")
        address = argument_value(worker["argv"], worker["env"], "--coordinator")
        host = address.rsplit(":", 1)[0].split(".")[0] if address else None
        target = service_ports.get((host, port_of(address)))
        if target != port_of(listen):
            error(wwhere, f"--coordinator {address!r} does not reach the coordinator's --listen "
                          f"port through a Service (Service ports: {service_ports})")
        worker_host = worker["env_sources"].get("SHARD_HOST", {})
        if "status.podIP" not in json.dumps(worker_host) and \
                argument_value(worker["argv"], worker["env"], "--host") is None:
            error(wwhere, "--host is not the pod IP (peers could not reach the data path)")
    if not by_kind.get("PodDisruptionBudget"):
        error("deploy/k8s", "has no PodDisruptionBudget")


def guarded(where, check, *args):
    """Runs one group of checks; a file too broken to check is one error, not a traceback."""
    try:
        check(*args)
    except Exception as e:  # noqa: BLE001 - any failure here is a broken deployment file
        error(where, f"could not be checked: {type(e).__name__}: {e}")


# --- main -------------------------------------------------------------------------------------
def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    bin_dir = os.path.abspath(sys.argv[1])
    root = os.path.abspath(sys.argv[2] if len(sys.argv) > 2 else
                           os.path.join(os.path.dirname(__file__), "..", ".."))
    deploy = os.path.join(root, "deploy")
    for binary in BINARIES:
        if help_of(bin_dir, [binary]) is None:
            print(f"check_deploy: FAILED: cannot run {os.path.join(bin_dir, binary)} --help "
                  f"(build the binaries first)")
            return 1

    # 1. Every YAML and JSON file parses; job specs use JobSpec's fields only.
    messages = proto_messages(os.path.join(root, "proto", "shard", "v1", "job.proto"))
    for directory, _, files in os.walk(deploy):
        for file in sorted(files):
            path = os.path.join(directory, file)
            name = os.path.relpath(path, root)
            try:
                if file.endswith((".yml", ".yaml")):
                    list(yaml.safe_load_all(open(path)))
                    checked["yaml"] += 1
                elif file.endswith(".json"):
                    spec = json.load(open(path))
                    checked["json"] += 1
                    if "worldSize" in spec or "world_size" in spec:
                        check_job_spec(name, spec, messages)
            except (yaml.YAMLError, ValueError) as e:
                error(name, f"does not parse: {e}")

    # 2. The binaries' own environment names follow the convention.
    for binary in BINARIES:
        for flag, option in help_of(bin_dir, [binary]).options.items():
            if option["env"] and option["env"] != env_name(flag):
                error(f"{binary} --help", f"{flag} reads {option['env']}, but the convention is "
                                          f"{env_name(flag)}")

    # 3. The contract's flags exist.
    missing = {b: [f for f in flags if f not in help_of(bin_dir, [b]).options]
               for b, flags in CONTRACT.items()}
    for binary, flags in missing.items():
        if flags:
            error(f"{binary} --help", f"missing contract flags: {' '.join(flags)}")

    # 4. Dockerfiles, compose, Kubernetes.
    dockerfiles = {}
    docker_dir = os.path.join(deploy, "docker")
    for file in sorted(os.listdir(docker_dir)):
        if file.endswith("Dockerfile"):
            path = os.path.join(docker_dir, file)
            dockerfiles[path] = Dockerfile(path, root)
            guarded(os.path.relpath(path, root), check_dockerfile, bin_dir, root,
                    dockerfiles[path])
    if not dockerfiles:
        error("deploy/docker", "has no Dockerfile")
    guarded("deploy/docker-compose*.yml", check_compose, bin_dir, root, dockerfiles, messages)
    guarded("deploy/k8s", check_k8s, bin_dir, root, dockerfiles, messages)

    compose = None
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"],
                                                 capture_output=True).returncode == 0:
        compose = ["docker", "compose"]
    elif shutil.which("docker-compose"):
        compose = ["docker-compose"]
    if compose:
        result = subprocess.run(compose + ["-f", os.path.join(deploy, "docker-compose.yml"),
                                           "config", "-q"], capture_output=True, text=True)
        if result.returncode != 0:
            error("docker-compose.yml", f"{' '.join(compose)} config: {result.stderr.strip()}")
        else:
            print(f"check_deploy: {' '.join(compose)} config accepts docker-compose.yml")
    else:
        print("check_deploy: SKIPPED `docker compose config` (no compose plugin installed); "
              "the compose file was checked structurally")

    report("warning", warnings)
    summary = (f"{checked['yaml']} YAML and {checked['json']} JSON files, {checked['commands']} "
               f"command lines, {checked['flags']} flags, {checked['env']} environment variables")
    if errors:
        report("ERROR", errors)
        print(f"check_deploy: FAILED: {len(errors)} problem(s) in {summary}")
        return 1
    print(f"check_deploy: OK: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
