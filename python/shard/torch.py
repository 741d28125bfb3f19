"""PyTorch models on Shard: a normal torch training loop, sharded, overlapped and elastic.

    import torch
    import shard.torch as shard

    job = shard.join()                              # SHARD_COORDINATOR (or coordinator="host:port");
                                                    # blocks until the world is formed
    model = Net().to(job.device)                    # any nn.Module with fp32 parameters
    engine = job.wrap(model)                        # parameters and gradients become views of
                                                    # Shard's flat buckets
    for step in job.steps():                        # the global steps still to run
        idx = job.batch_indices(step, len(dataset)) # this rank's share of global batch `step`
        x, y = dataset[idx]
        loss = loss_fn(model(x), y)                 # mean over this rank's samples
        loss.backward()                             # hooks mark gradients ready: buckets reduce
        engine.step()                               # during backward; then the sharded update
        job.report(loss=loss.item())
    job.finish()                                    # rank 0 wrote output_dir/final.safetensors

The job spec (the coordinator's --job, with "model": {"external": {}}) decides the optimizer,
ZeRO stage, buckets, clipping, global batch, steps and checkpoints; the loop has no optimizer of
its own. Gradients are averaged over the ranks as DDP does, so with the global batch divisible
by the world size the result equals one process training on the whole batch. `job.steps()`
hides re-formations: when a worker dies or the world is resized, the step in flight is dropped,
the new world restores the newest checkpoint, and the loop goes on from the step after it.

On a GPU (device "cuda:N"), the parameters and gradients are views of Shard's device buffers
(DLPack), the gradient reductions run on NCCL (or, with backend "gloo", on Gloo staged through
host memory, for several ranks on one GPU), and Shard's work is ordered with torch's current
stream through CUDA events: no device-wide synchronization. bf16 autocast works as in plain
torch (the parameters and gradients Shard keeps are fp32); fp16 autocast would need a gradient
scaler that knows Shard's step, which there is not yet.

Configuration comes from join()'s arguments or the environment: SHARD_COORDINATOR, SHARD_ID (the
worker id; default host-pid), SHARD_DEVICE ("cpu" or "cuda:N"; default cpu), SHARD_BACKEND
("auto": NCCL on a GPU, Gloo on the host; "gloo"; "nccl"), SHARD_TRANSPORT (host memory between
ranks: "auto", shared memory when every rank is on this host and TCP otherwise; "tcp", snapshot
replicas too; "shm"),
SHARD_HOST (where peers reach this rank; default 127.0.0.1),
SHARD_COORDINATOR_TIMEOUT and SHARD_COLLECTIVE_TIMEOUT (seconds), SHARD_LOG_LEVEL,
SHARD_JOB_TOKEN_FILE, SHARD_TLS_CA, SHARD_TLS_CERT, SHARD_TLS_KEY, SHARD_TLS_SERVER_NAME.
"""

import contextlib
import copy
import ctypes
import fnmatch
import json
import os
import socket
import sys
import warnings
import weakref

import torch

from . import _lib, data
from ._lib import ShardError, check, lib
from .optim import ShardOptimizer, dumps, loads
from .units import Units, from_dlpack

# shard.torch is a module: `import shard.torch.data` and `from shard.torch.data import ...`
# find the data module under this name too.
sys.modules[__name__ + ".data"] = data

__all__ = ["join", "Job", "Engine", "ShardOptimizer", "ShardError", "data"]


def join(coordinator=None, worker_id=None, host=None, device=None, backend=None, transport=None,
         coordinator_timeout=None, collective_timeout=None, log_level=None, job_token_file=None,
         tls_ca=None, tls_cert=None, tls_key=None, tls_server_name=None):
    """Joins the job's coordinator and blocks until the world is formed and this process holds a
    rank. Arguments left out come from the SHARD_* environment variables (module docstring)."""
    env = os.environ.get
    config = {
        "coordinator": coordinator or env("SHARD_COORDINATOR"),
        "worker_id": worker_id or env("SHARD_ID") or f"{socket.gethostname()}-{os.getpid()}",
        "host": host or env("SHARD_HOST"),
        "device": str(device or env("SHARD_DEVICE") or "cpu"),
        "backend": backend or env("SHARD_BACKEND"),
        "transport": transport or env("SHARD_TRANSPORT"),
        "coordinator_timeout_s": _seconds(coordinator_timeout or env("SHARD_COORDINATOR_TIMEOUT")),
        "collective_timeout_s": _seconds(collective_timeout or env("SHARD_COLLECTIVE_TIMEOUT")),
        "log_level": log_level or env("SHARD_LOG_LEVEL"),
        "job_token_file": job_token_file or env("SHARD_JOB_TOKEN_FILE"),
        "tls_ca": tls_ca or env("SHARD_TLS_CA"),
        "tls_cert": tls_cert or env("SHARD_TLS_CERT"),
        "tls_key": tls_key or env("SHARD_TLS_KEY"),
        "tls_server_name": tls_server_name or env("SHARD_TLS_SERVER_NAME"),
    }
    if not config["coordinator"]:
        raise ShardError(_lib.INVALID_ARGUMENT,
                         "no coordinator: pass coordinator='host:port' or set SHARD_COORDINATOR")
    config = {key: value for key, value in config.items() if value is not None}
    handle = ctypes.c_void_p()
    check(lib.shard_join(json.dumps(config).encode(), ctypes.byref(handle)))
    return Job(handle, torch.device(config["device"]))


def _seconds(value):
    """A timeout in seconds: a number, or a string such as "60", "60s" or "2m"."""
    if value is None or isinstance(value, (int, float)):
        return value
    text = str(value).strip()
    for suffix, factor in (("ms", 1e-3), ("s", 1.0), ("m", 60.0), ("h", 3600.0)):
        if text.endswith(suffix):
            return float(text[:-len(suffix)]) * factor
    return float(text)


class Job:
    """One rank's membership in a Shard job (made by join())."""

    def __init__(self, handle, device):
        self._handle = handle
        self._device = device
        # Leaves the job when the Job is collected or the interpreter exits, whatever happened.
        self._close = weakref.finalize(self, lib.shard_job_close, handle)
        self._engine = None
        self._info = None
        self._loss = None
        self._failure = None  # (code, message) of a step the generation's end made fail
        self._extras_error = None  # what the extras callback raised during a save
        self._over = False
        self._output_path = ""
        self._step = None  # the step being trained
        self._initial_state = None  # the job's extras and optimizer settings before any step
        self.checkpoint_extras = {}
        self._extras_callback = _lib.EXTRAS_CALLBACK(self._put_extras)
        check(lib.shard_set_extras_callback(handle, self._extras_callback, None))
        self._refresh()

    def _refresh(self):
        text = ctypes.c_char_p()
        check(lib.shard_job_info(self._handle, ctypes.byref(text)))
        self._info = json.loads(text.value)

    @property
    def rank(self):
        """This process's rank in the current generation of the world."""
        return self._info["rank"]

    @property
    def device(self):
        """The torch.device this rank trains on (the model must be there before wrap())."""
        return self._device

    @property
    def world_size(self):
        return self._info["world_size"]

    @property
    def generation(self):
        return self._info["generation"]

    @property
    def worker_id(self):
        return self._info["worker_id"]

    @property
    def next_step(self):
        """The 0-based step the latest generation began with (after a restore, the one after the
        restored step); None before job.steps() began one. A DataLoader's sampler iterated anew
        for each generation starts there (shard.torch.data.ElasticSampler, job.steps(loader))."""
        return self._info.get("next_step")

    # checkpoint_extras (a dict, set in __init__): small values saved by rank 0 with every
    # checkpoint and memory snapshot and restored on every rank. A value with state_dict() and
    # load_state_dict() (an lr_scheduler, a sampler) is saved and restored through them, in
    # place; others (numbers, lists, dicts) are replaced by their saved values. When a generation
    # starts afresh (no checkpoint yet), they go back to what they were before the first step.

    def _extras_state(self):
        return {key: value.state_dict() if hasattr(value, "state_dict") else value
                for key, value in self.checkpoint_extras.items()}

    def _job_state(self):
        """What rank 0 saves for the whole job: the extras and the optimizer's settings."""
        optimizer = self._engine._optimizer if self._engine is not None else None
        return {"extras": self._extras_state(),
                "optimizer": optimizer._job_state() if optimizer is not None else None}

    def _load_job_state(self, state):
        optimizer = self._engine._optimizer
        if optimizer is not None and state.get("optimizer") is not None:
            optimizer._load_job_state(state["optimizer"])
        for key, value in state["extras"].items():
            current = self.checkpoint_extras.get(key)
            if hasattr(current, "load_state_dict"):
                current.load_state_dict(value)
            else:
                self.checkpoint_extras[key] = value

    def _put_extras(self, _context):
        """libshard's extras callback, at every save: hands over what this rank saves besides
        Shard's arrays. Returns non-zero on failure (raised again by steps())."""
        try:
            def put(param, data):
                check(lib.shard_put_extra(self._handle, param, data, len(data)))

            optimizer = self._engine._optimizer
            if optimizer is not None:
                optimizer._put_extras(put)
            if self.rank == 0 and (optimizer is not None or self.checkpoint_extras):
                put(-1, dumps(self._job_state()))
            return 0
        except BaseException as e:  # noqa: BLE001 - kept and raised by steps()
            self._extras_error = e
            return 1

    @property
    def spec(self):
        """The job spec as the coordinator holds it (a dict of its JSON, field names as in the
        .proto: global_batch, steps, optimizer, ...)."""
        return self._info["job"]

    def wrap(self, model, units=None):
        """Puts `model`'s parameters and gradients in Shard's buffers and returns the Engine whose
        step() trains it. Once per job; the model must be on job.device with fp32 parameters and
        must not be moved afterwards (model.to(...) would detach it from Shard).

        At ZeRO stage 3 ("zeroStage": 3) each rank keeps 1/W of the parameters and gathers a
        unit's while the unit computes (shard.units). `units` chooses the unit modules: None
        (FSDP's size-based policy: a module becomes a unit once the parameters of its subtree
        not yet in a unit number at least one bucket's worth, bucketCapMb / 4 bytes), a number
        of parameters for that policy, a module class or tuple of classes (every instance, e.g.
        the transformer's block), or a list of submodules; the model itself is always the
        outermost unit. Other stages ignore it."""
        if self._engine is not None:
            raise ShardError(_lib.FAILED_PRECONDITION, "wrap() was called already: one model a job")
        self._engine = Engine(self, model, units)
        return self._engine

    def batch_indices(self, step, n):
        """This rank's sample indices of global batch `step` of a data set of `n` samples: the
        global batch B covers samples [step*B, (step+1)*B) modulo n, and rank r of W takes the
        r-th contiguous B/W of them, so the data order does not depend on the world size."""
        batch = int(self.spec["global_batch"])
        share = batch // self.world_size
        first = step * batch + self.rank * share
        return torch.arange(first, first + share, dtype=torch.int64) % n

    def report(self, loss=None):
        """This rank's loss for the step (its mean over this rank's samples); the step boundary
        averages it over the ranks and reports it with the step's statistics."""
        if loss is not None:
            self._loss = float(loss)

    def steps(self, loader=None):
        """Yields the global step numbers (0-based) still to run, across re-formations of the
        world and restores; ends when the job is over (trained, or stopped by an operator).

        With `loader` (an iterable such as a DataLoader, typically over an ElasticSampler), yields
        (step, batch) pairs instead: the loader is iterated anew at the start of every generation,
        once the world and the restored step are known, so that after a re-formation its batches
        start at the step training goes on from; what a DataLoader's workers had prefetched for
        the steps that were dropped is thrown away."""
        if self._engine is None:
            raise ShardError(_lib.FAILED_PRECONDITION, "wrap(model) before steps()")
        engine = self._engine
        while True:
            engine._use_current_stream()
            began, needs_init = ctypes.c_int(), ctypes.c_int()
            check(lib.shard_generation_begin(self._handle, ctypes.byref(began),
                                             ctypes.byref(needs_init)))
            if not began.value:
                self._over = True
                return
            self._refresh()
            ended = self._train_generation(engine, bool(needs_init.value))
            if ended is None:
                continue
            if loader is None:
                yield from ended
            else:
                yield from self._with_batches(ended, loader)

    def _with_batches(self, steps, loader):
        """Pairs one generation's steps with the batches of a fresh iterator over `loader`."""
        batches = iter(loader)
        try:
            for step in steps:
                try:
                    batch = next(batches)
                except StopIteration:
                    raise ShardError(_lib.FAILED_PRECONDITION,
                                     f"the loader ran out of batches at step {step}: it must yield "
                                     "one batch per step up to the job's last "
                                     "(shard.torch.data.ElasticSampler does)") from None
                yield step, batch
        finally:
            del batches  # a DataLoader's workers stop with their iterator

    def _train_generation(self, engine, needs_init):
        """Runs one generation; returns a generator of its steps (None when it ended at once)."""
        code, message = engine._attach(needs_init)
        if code:
            self._end_generation(code, message)
            return None
        if self._initial_state is None:
            self._initial_state = copy.deepcopy(self._job_state())
        saved = engine._restored_extra(-1)
        if saved is not None:
            self._load_job_state(loads(saved))
        elif needs_init:
            self._load_job_state(copy.deepcopy(self._initial_state))
        if engine._optimizer is not None:
            engine._optimizer._on_generation(restored=saved is not None)
        return self._generation_steps(engine)

    def _generation_steps(self, engine):
        step = ctypes.c_int64()
        while True:
            engine._use_current_stream()
            code = lib.shard_step_begin(self._handle, ctypes.byref(step))
            if code:
                self._end_generation(code, lib.shard_last_error().decode())
                return
            if step.value < 0:  # the last step was done already (restored at the end)
                self._end_generation(0, "", finished=True)
                return
            self._loss = None
            self._failure = None
            self._step = step.value
            engine._step_begun()
            code = engine._buffers_in()
            if code:
                self._end_generation(code, lib.shard_last_error().decode())
                return
            yield step.value
            if self._failure is not None:
                self._end_generation(*self._failure)
                return
            engine._buffers_out()
            boundary = ctypes.c_int()
            loss = self._loss if self._loss is not None else 0.0
            code = lib.shard_step_end(self._handle, ctypes.c_double(loss), ctypes.byref(boundary))
            if code:
                self._end_generation(code, lib.shard_last_error().decode())
                if self._extras_error is not None:
                    error, self._extras_error = self._extras_error, None
                    raise error
                return
            if boundary.value != _lib.CONTINUE:
                self._end_generation(0, "", finished=boundary.value == _lib.FINISHED)
                return

    def _end_generation(self, code, message, finished=False):
        """Hands the generation back with how it ended. The worker decides what an error means:
        the end of the generation (a peer died, the world moved on: the next begin waits for
        the next one) or of the job (the next begin raises it)."""
        self._engine._detach(gather=finished)
        path = ctypes.c_char_p()
        if lib.shard_generation_end(self._handle, code, message.encode(), ctypes.byref(path)) == 0:
            if path.value:
                self._output_path = path.value.decode()
                self._engine._complete_export(self._output_path)

    def finish(self):
        """After steps() ended: leaves the job and returns the path of the exported parameters
        (output_dir/final.safetensors, under the model's state_dict names) on rank 0, else ""."""
        if not self._over:
            raise ShardError(_lib.FAILED_PRECONDITION, "finish() before steps() ended")
        self.close()
        return self._output_path

    def close(self):
        """Leaves the job now (also done when the Job is collected or the process exits). The
        model keeps the values its parameters had."""
        if self._engine is not None:
            self._engine._detach()
        self._close()


class Engine:
    """The model's parameters as views of Shard's buffers, and the sharded step (Job.wrap)."""

    def __init__(self, job, model, units=None):
        self._job = job
        self._model = model
        self._device = job.device
        self._params = []
        manifest = []
        for name, param in model.named_parameters():
            if param.dtype != torch.float32:
                raise ShardError(_lib.INVALID_ARGUMENT,
                                 f"parameter {name} is {param.dtype}; Shard keeps fp32 parameters "
                                 "(call model.float() before wrap)")
            if param.device != self._device:
                raise ShardError(_lib.INVALID_ARGUMENT,
                                 f"parameter {name} is on {param.device} but this rank trains on "
                                 f"{self._device}: move the model there (model.to(job.device)) "
                                 "before wrap")
            manifest.append({"name": name, "shape": list(param.shape) or [1], "dtype": "f32",
                             "requires_grad": param.requires_grad})
            self._params.append(param)
        if not self._params:
            raise ShardError(_lib.INVALID_ARGUMENT, "the model has no parameters")
        # Persistent buffers (BatchNorm's running statistics and batch count, ...) join the
        # manifest as fp32 tensors without gradient: checkpointed and restored with the
        # parameters, and rank 0's are broadcast before every step, as DDP's broadcast_buffers
        # does. The module keeps its own tensors (of any dtype fp32 holds exactly: 16-bit floats,
        # integers below 2^24, bools); they are copied in and out at the step's edges.
        persistent = set(model.state_dict().keys())
        self._buffer_names, self._unmanaged = [], []
        for name, buffer in model.named_buffers():
            if name not in persistent:
                continue  # the module rebuilds it
            if buffer.dtype in _EXACT_IN_FP32 and buffer.device == self._device:
                manifest.append({"name": name, "shape": list(buffer.shape) or [1], "dtype": "f32",
                                 "requires_grad": False})
                self._buffer_names.append(name)
            else:
                self._unmanaged.append(name)
        if self._unmanaged:
            warnings.warn(
                f"shard.torch: buffers {', '.join(self._unmanaged[:4])} are of a dtype Shard does "
                "not keep: each rank keeps its own, they are not checkpointed, and the export "
                "takes rank 0's", stacklevel=3)
        check(lib.shard_job_set_model(job._handle, json.dumps({"params": manifest}).encode()))
        # Where a generation that restores nothing starts: the values the model holds now.
        self._initial = [p.detach().clone() for p in self._params] + [
            model.get_buffer(name).detach().clone() for name in self._buffer_names]
        self._layout = None
        self._views = []  # (param view, grad view or None) by index
        self._buffer_views = []  # by self._buffer_names
        self._hooks = []
        self._syncing = True  # False inside no_sync(): gradients accumulate, nothing reduces
        self._misuse = None  # what a gradient hook found wrong, raised by step()
        self._optimizer = None  # the script's own (optimizer()), else the job spec's runs
        self._grad_versions = {}  # by index: the gradient's version when backward last made it
        self._units = None  # stage 3's unit hooks (shard.units)
        # Once the buckets are final (stages 0 to 2): each trainable parameter's bucket, each
        # bucket's count of them, and this step's gradients counted and still to come by bucket.
        self._bucket_of = None
        self._bucket_sizes = []
        self._counted = set()
        self._unmarked = []
        if int(job.spec.get("zero_stage", 0)) == 3:
            bucket_params = int(float(job.spec.get("bucket_cap_mb", 25)) * 2**20 / 4)
            self._units = Units(self, model, self._params, units, max(1, bucket_params))
        self._install_hooks()

    def _install_hooks(self):
        """A gradient-ready hook per trainable parameter: it runs once autograd has accumulated
        the parameter's gradient into its view, and tells Shard, whose bucket then reduces."""
        handle = self._job._handle
        for index, param in enumerate(self._params):
            if not param.requires_grad:
                continue

            def ready(*_, index=index, param=param):
                if not self._views:  # between generations or after the job: plain torch
                    return
                if self._units is not None:
                    misuse = self._units.gradient_ready(index, self._syncing)
                    if misuse is not None and self._misuse is None:
                        self._misuse = misuse
                    return
                view = self._views[index][1]
                if param.grad is None or param.grad.data_ptr() != view.data_ptr():
                    # Raised by step(): an exception inside autograd's hooks can leave torch
                    # 1.13's graph alive in a thread-local that hangs the interpreter's exit.
                    self._misuse = (
                        f"the gradient of {self._names()[index]} is no longer Shard's buffer: "
                        "do not call zero_grad(set_to_none=True) or assign .grad (Shard zeroes "
                        "the gradients itself at every step)")
                else:
                    # What the gradient's version is once backward is done with it: a change
                    # after that (clip_grad_norm_) would hit values the bucket is reducing.
                    self._grad_versions[index] = param.grad._version
                    if self._syncing:
                        self._mark_ready(handle, index)

            if hasattr(param, "register_post_accumulate_grad_hook"):  # torch >= 2.1
                self._hooks.append(param.register_post_accumulate_grad_hook(ready))
            else:  # torch 1.13-2.0: a hook on the parameter's AccumulateGrad node
                accumulate = param.expand_as(param).grad_fn.next_functions[0][0]
                self._hooks.append(accumulate.register_hook(ready))
                self._hooks.append(accumulate)  # keeps the node, and so its hook, alive

    def _mark_ready(self, handle, index):
        """Tells Shard once a bucket's gradients are all complete: one call a bucket, not one a
        parameter. Until the buckets are final, each gradient as it comes: the first step's ready
        order rebuilds them."""
        if self._bucket_of is None:
            lib.shard_mark_ready(handle, index)
            return
        if index in self._counted:  # a second backward without no_sync(): counted once
            return
        self._counted.add(index)
        bucket = self._bucket_of[index]
        self._unmarked[bucket] -= 1
        if self._unmarked[bucket] == 0:
            lib.shard_mark_bucket_ready(handle, bucket)

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation over micro-batches, as DDP's no_sync: backward passes inside the
        context only accumulate into the gradients; the next backward outside it adds the last
        micro-batch and reduces, once per step. Scale each micro-batch's loss by 1/micro-batches
        to keep the mean."""
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = True

    def _use_current_stream(self):
        """Tells Shard the stream torch computes on now: Shard's work on the buffers is ordered
        with it by CUDA events (capi/shard.h, shard_set_stream)."""
        if self._device.type == "cuda":
            stream = torch.cuda.current_stream(self._device).cuda_stream
            check(lib.shard_set_stream(self._job._handle, stream))

    def _named_params(self):
        """(name, parameter) in registration order: the manifest's order of self._params."""
        return list(zip(self._names(), self._params))

    def _names(self):
        return [name for name, _ in self._model.named_parameters()]

    def optimizer(self, optimizer_class, params=None, **defaults):
        """The script's own torch.optim class as the sharded update rule, for a job spec whose
        optimizer is {"name": "torch"}: `optimizer_class(params, **defaults)` as with torch
        (params: None for every trainable parameter, parameters, or param groups whose "params"
        are parameters or name patterns such as "*.bias"), run by each rank over what it updates
        (shard.optim). Returns a torch.optim.Optimizer: its step() is this engine's step (call
        one of them per step), its param_groups take an lr_scheduler. Once, before steps()."""
        if self._optimizer is not None:
            raise ShardError(_lib.FAILED_PRECONDITION, "optimizer() was called already: one a job")
        if self._layout is not None or self._job.next_step is not None:
            raise ShardError(_lib.FAILED_PRECONDITION,
                             "make the optimizer before job.steps() begins")
        name = self._job.spec.get("optimizer", {}).get("name")
        if name != "torch":
            raise ShardError(_lib.FAILED_PRECONDITION,
                             f"the job spec's optimizer is the built-in \"{name}\", which "
                             "engine.step() runs; to bring your own class, set \"optimizer\": "
                             "{\"name\": \"torch\"} in the job spec")
        self._optimizer = ShardOptimizer(self, optimizer_class, params, defaults)
        return self._optimizer

    def _attach(self, needs_init):
        """Points the parameters at this generation's buffers, and fills them when it starts from
        scratch. Returns (code, message) of a failure that ended the generation, else (0, "")."""
        self._repoint()
        if self._units is not None:
            self._units.active = True
        if not needs_init:
            return 0, ""
        with torch.no_grad():
            views = [param_view for param_view, _ in self._views] + self._buffer_views
            for index, (view, initial) in enumerate(zip(views, self._initial)):
                if view is None:  # sharded (stage 3)
                    self._units.set_initial(index, initial)
                else:
                    view.copy_(initial.reshape(view.shape))
        code = lib.shard_generation_init(self._job._handle)
        return code, (lib.shard_last_error().decode() if code else "")

    def _detach(self, gather=False):
        """Gives the parameters memory of their own, holding their current values: the
        generation's buffers go away with it, and the model must stay usable (evaluated, saved)
        after training and between generations. At stage 3 no rank holds the trainable ones
        whole: with `gather` (the job's last step is done, every rank is here) they are gathered
        onto every rank, one bucket at a time; otherwise they keep their shapes over a NaN
        placeholder until the next generation restores them."""
        if self._layout is None:
            return
        if self._optimizer is not None:
            self._optimizer._detach()
        if self._units is not None:
            self._units.end_step()
            if not (gather and self._units.gather_all()):
                self._units.point_at_placeholders()
            self._units.active = False
        with torch.no_grad():
            for index, param in enumerate(self._params):
                if self._views[index][0] is not None:
                    param.data = param.data.clone()
                param.grad = None
        self._views = []
        self._buffer_views = []
        self._layout = None

    def _repoint(self):
        version = ctypes.c_int64()
        check(lib.shard_layout_version(self._job._handle, ctypes.byref(version)))
        if version.value == self._layout:
            return
        views = []
        handle = self._job._handle
        for index, param in enumerate(self._params):
            if self._units is not None and param.requires_grad:
                views.append((None, None))  # gathered by its units' hooks
                continue
            param_view = _view(handle, index, False, param.shape)
            grad_view = _view(handle, index, True, param.shape) if param.requires_grad else None
            with torch.no_grad():
                param.data = param_view
                if grad_view is not None:
                    param.grad = grad_view
            views.append((param_view, grad_view))
        self._views = views
        if self._units is not None:
            self._units.load_layout(version.value)
        self._load_buckets()
        self._buffer_views = []
        for offset, name in enumerate(self._buffer_names):
            self._buffer_views.append(_view(handle, len(self._params) + offset, False,
                                            self._model.get_buffer(name).shape))
        self._layout = version.value

    def _buffers_in(self):
        """Before a step: every rank takes rank 0's buffers (or, after a restore, the
        checkpoint's). Returns the code of a failed broadcast, else 0."""
        for offset, (name, view) in enumerate(zip(self._buffer_names, self._buffer_views)):
            code = lib.shard_broadcast(self._job._handle, len(self._params) + offset)
            if code:
                return code
            with torch.no_grad():
                buffer = self._model.get_buffer(name)
                buffer.copy_(view.reshape(buffer.shape))
        return 0

    def _buffers_out(self):
        """After a step: the buffers as the step left them, for the checkpoint and export."""
        with torch.no_grad():
            for name, view in zip(self._buffer_names, self._buffer_views):
                view.copy_(self._model.get_buffer(name).reshape(view.shape))

    def _complete_export(self, path):
        """Makes rank 0's export hold every key of the model's state_dict, so that it loads with
        load_state_dict(strict=True): the buffers in their own dtype and shape (Shard holds them
        as fp32, or not at all), and the other names of shared (tied) parameters, which
        named_parameters() and so the manifest list once."""
        from .safetensors import load_file, metadata, save_file
        tensors = load_file(path)
        missing = {name: value for name, value in self._model.state_dict().items()
                   if name not in tensors or name in self._buffer_names}
        if not missing:
            return
        for name, value in missing.items():
            tensors[name] = value.detach().cpu()
        save_file(tensors, path, metadata(path))

    def step(self):
        """Waits for the gradient reductions, clips, updates the part of the optimizer state this
        rank owns, and gathers the parameters (with the script's own optimizer: its step(), which
        an lr_scheduler counts). If the generation ended under it (a worker died, the world is
        resized), it returns quietly and steps() restores the newest checkpoint; any other
        failure is raised by steps() once the worker has given up the job."""
        if self._optimizer is not None:
            self._optimizer.step()
            return
        self._check_buffers()
        if self._job._failure is not None:  # a stage-3 gather of this step failed
            return
        code = lib.shard_step(self._job._handle)
        if code:
            # steps() hands the failure to the worker, which ends this generation or the job.
            self._job._failure = (code, lib.shard_last_error().decode())
            return
        self._repoint()  # the first step rebuilds the buckets in the gradients' ready order

    def _check_buffers(self):
        """Raises what went wrong with the parameters' and gradients' views since the last step."""
        if self._misuse is not None:
            misuse, self._misuse = self._misuse, None
            raise ShardError(_lib.FAILED_PRECONDITION, misuse)
        if not self._views:
            raise ShardError(_lib.FAILED_PRECONDITION, "step() belongs inside job.steps()")
        for index, param in enumerate(self._params):
            view = self._views[index][0]
            if view is not None and param.data_ptr() != view.data_ptr():
                raise ShardError(
                    _lib.FAILED_PRECONDITION,
                    f"parameter {self._names()[index]} is no longer Shard's buffer: do not move "
                    "or replace the model's parameters after wrap() (model.to(), .data = ...)")
        versions, self._grad_versions = self._grad_versions, {}
        for index, version in versions.items():
            grad = self._params[index].grad
            if grad is None:  # zero_grad(set_to_none=True) after backward
                raise ShardError(
                    _lib.FAILED_PRECONDITION,
                    f"the gradient of {self._names()[index]} is no longer Shard's buffer: do not "
                    "call zero_grad(set_to_none=True) or assign .grad (Shard zeroes the gradients "
                    "itself at every step)")
            if grad._version != version:
                raise ShardError(
                    _lib.FAILED_PRECONDITION,
                    f"the gradient of {self._names()[index]} changed after backward made it "
                    "(clip_grad_norm_, or another in-place change of .grad before the step): "
                    "Shard reduces gradients during backward, so the change would hit values "
                    "being reduced. Clip with the job spec's gradClipNorm instead")
        if self._units is not None:
            self._units.end_step()

    def _load_buckets(self):
        """The trainable parameters' buckets, when they are final (see _mark_ready)."""
        self._bucket_of = None
        if self._units is not None:
            return
        text = ctypes.c_char_p()
        check(lib.shard_param_layout(self._job._handle, ctypes.byref(text)))
        layout = json.loads(text.value)
        if not layout["final"]:
            return
        self._bucket_sizes = [0] * len(layout["buckets"])
        for index, param in enumerate(self._params):
            if param.requires_grad:
                self._bucket_sizes[layout["params"][index][0]] += 1
        self._bucket_of = [bucket for bucket, _ in layout["params"]]
        self._step_begun()

    def _step_begun(self):
        if self._units is not None:
            self._units.begin_step()
        self._counted = set()
        self._unmarked = list(self._bucket_sizes)

    def _torch_step(self, optimizer):
        """The step with the script's optimizer: Shard reduces (and clips), the optimizer updates
        what this rank owns, Shard gathers."""
        self._check_buffers()
        if optimizer._stepped_at == (self._job.generation, self._job._step):
            raise ShardError(_lib.FAILED_PRECONDITION,
                             f"step {self._job._step} was stepped already: call opt.step() or "
                             "engine.step(), once a step")
        optimizer._stepped_at = (self._job.generation, self._job._step)
        if self._job._failure is not None:  # a stage-3 gather of this step failed
            return
        handle = self._job._handle
        update = ctypes.c_int()
        code = lib.shard_step_reduce(handle, ctypes.byref(update))
        if code:
            self._job._failure = (code, lib.shard_last_error().decode())
            return
        self._repoint()  # the first step rebuilds the buckets in the gradients' ready order
        if update.value:
            optimizer._update()
        code = lib.shard_step_finish(handle, update.value)
        if code:
            self._job._failure = (code, lib.shard_last_error().decode())

    def consolidated_state_dict(self, to=0, model=True):
        """ZeroRedundancyOptimizer's consolidate_state_dict for the model and its optimizer:
        collective (every rank calls it, inside job.steps()); rank `to` gets {"model": the
        model's state_dict (every key, tied names included), "optimizer": the optimizer's
        state_dict as a plain torch optimizer of its class over the same groups has it}, in
        host memory, and the other ranks None. One parameter at a time: no rank but `to` holds
        more than the largest parameter's state beyond its own shard."""
        if not self._views:
            raise ShardError(_lib.FAILED_PRECONDITION,
                             "consolidated_state_dict() works inside job.steps(), while a "
                             "generation trains")
        self._use_current_stream()
        mine = self._job.rank == to
        result = {}
        if model:
            result["model"] = self._host_state_dict(to)
        if self._optimizer is not None:
            result["optimizer"] = self._optimizer._consolidate(to)
        else:
            result["optimizer"] = self._consolidate_builtin(to)
        return result if mine else None

    def _host_state_dict(self, to):
        """The model's state_dict copied to host memory on rank `to` (None elsewhere), tied names
        sharing one copy. Collective: at stage 3 the sharded parameters are gathered to `to`,
        one at a time."""
        mine = self._job.rank == to
        gathered = {}
        for index, (view, _) in enumerate(self._views):
            if view is None:
                param = self._params[index]
                out = torch.empty(param.numel()) if mine else None
                check(lib.shard_gather_to_rank(self._job._handle, index, -1, to,
                                               out.data_ptr() if mine else None))
                gathered[id(param)] = out.view(param.shape) if mine else None
        if not mine:
            return None
        copies, state = {}, {}
        for name, value in self._model.state_dict(keep_vars=True).items():
            if id(value) in gathered:
                state[name] = gathered[id(value)]
                continue
            key = (value.data_ptr(), value.dtype, tuple(value.shape))
            if key not in copies:
                copies[key] = value.detach().to("cpu", copy=True)
            state[name] = copies[key]
        return state

    def _gather_extra(self, param, to, data):
        """Parameter `param`'s extras as their saving rank has them (`data` there), on rank `to`
        (b"" elsewhere, and where the parameter has none). Collective."""
        out, size = ctypes.c_void_p(), ctypes.c_size_t()
        check(lib.shard_gather_extra(self._job._handle, param, to, data, len(data),
                                     ctypes.byref(out), ctypes.byref(size)))
        return ctypes.string_at(out.value, size.value) if size.value else b""

    def _gather_arrays(self, param, to, count):
        """Parameter `param`'s optimizer state arrays 0..count-1 in full, in the parameter's
        shape, on rank `to` (None elsewhere). Collective."""
        shape = self._params[param].shape
        arrays = []
        for array in range(count):
            values = torch.empty(self._params[param].numel()) if self._job.rank == to else None
            check(lib.shard_gather_to_rank(self._job._handle, param, array, to,
                                           values.data_ptr() if values is not None else None))
            arrays.append(values.view(shape) if values is not None else None)
        return arrays

    def _consolidate_builtin(self, to):
        """The job spec's optimizer's state as torch's Adam, AdamW or SGD state_dict holds it:
        its groups (parameters in no group first), their settings, each parameter's state
        tensors and step count."""
        spec = self._job.spec["optimizer"]
        kind = spec["name"]
        names = (["momentum_buffer"] if float(spec.get("momentum", 0)) > 0 else []) \
            if kind == "sgd" else ["exp_avg", "exp_avg_sq"]
        self._job._refresh()
        step = float(self._job._info["optimizer_step"])
        settings = {"lr": float(spec["lr"]), "weight_decay": float(spec.get("weight_decay", 0))}
        if kind == "sgd":
            settings.update(momentum=float(spec.get("momentum", 0)), dampening=0,
                            nesterov=bool(spec.get("nesterov", False)))
        else:
            settings.update(betas=tuple(float(b) for b in spec.get("betas", (0.9, 0.999))),
                            eps=float(spec.get("eps", 1e-8)), amsgrad=False)
        patterns = spec.get("param_groups", [])
        members = [[] for _ in range(len(patterns) + 1)]
        for index, (name, param) in enumerate(self._named_params()):
            if not param.requires_grad:
                continue
            group = next((g + 1 for g, pattern in enumerate(patterns)
                          if any(fnmatch.fnmatchcase(name, m) for m in pattern["match"])), 0)
            members[group].append(index)
        state, groups, position = {}, [], 0
        for group, indices in enumerate(members):
            if not indices:
                continue
            hyper = dict(settings)
            if group > 0:
                pattern = patterns[group - 1]
                hyper["lr"] = settings["lr"] * float(pattern.get("lr_scale", 1))
                hyper["weight_decay"] = float(pattern.get("weight_decay", settings["weight_decay"]))
            groups.append(dict(hyper, params=list(range(position, position + len(indices)))))
            for index in indices:
                arrays = self._gather_arrays(index, to, len(names))
                if self._job.rank == to and step > 0:
                    state[position] = dict(zip(names, arrays))
                    if kind != "sgd":
                        state[position]["step"] = torch.tensor(step)
                position += 1
        return {"state": state, "param_groups": groups} if self._job.rank == to else None

    def _range_view(self, index, array):
        """A 1-D view of range `index` of shard_updated_ranges: values (array -1), gradient (-2)
        or optimizer state `array`."""
        managed = ctypes.c_void_p()
        check(lib.shard_range_dlpack(self._job._handle, index, array, ctypes.byref(managed)))
        return from_dlpack(managed)

    def _restored_extra(self, param):
        """What the generation's restore read of parameter `param`'s extras (-1: the job's), or
        None."""
        data, size = ctypes.c_void_p(), ctypes.c_size_t()
        check(lib.shard_restored_extra(self._job._handle, param, ctypes.byref(data),
                                       ctypes.byref(size)))
        return ctypes.string_at(data.value, size.value) if data.value else None


_EXACT_IN_FP32 = (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                  torch.int16, torch.int8, torch.uint8, torch.bool)


def _view(handle, index, grad, shape):
    """Tensor `index`'s values (or gradient) in Shard's memory, host or GPU, without a copy: a
    DLPack descriptor from libshard, whose deleter torch calls when the view goes."""
    managed = ctypes.c_void_p()
    check(lib.shard_tensor_dlpack(handle, index, int(grad), ctypes.byref(managed)))
    return from_dlpack(managed).view(shape)
