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
("auto": NCCL on a GPU, Gloo on the host; "gloo"; "nccl"), SHARD_HOST (where peers reach this
rank; default 127.0.0.1),
SHARD_COORDINATOR_TIMEOUT and SHARD_COLLECTIVE_TIMEOUT (seconds), SHARD_LOG_LEVEL,
SHARD_JOB_TOKEN_FILE, SHARD_TLS_CA, SHARD_TLS_CERT, SHARD_TLS_KEY, SHARD_TLS_SERVER_NAME.
"""

import contextlib
import ctypes
import json
import os
import socket
import warnings
import weakref

import torch
import torch.utils.dlpack

from . import _lib
from ._lib import ShardError, check, lib

__all__ = ["join", "Job", "Engine", "ShardError"]


def join(coordinator=None, worker_id=None, host=None, device=None, backend=None,
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
        self._over = False
        self._output_path = ""
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
    def spec(self):
        """The job spec as the coordinator holds it (a dict of its JSON, field names as in the
        .proto: global_batch, steps, optimizer, ...)."""
        return self._info["job"]

    def wrap(self, model):
        """Puts `model`'s parameters and gradients in Shard's buffers and returns the Engine whose
        step() trains it. Once per job; the model must be on job.device with fp32 parameters and
        must not be moved afterwards (model.to(...) would detach it from Shard)."""
        if self._engine is not None:
            raise ShardError(_lib.FAILED_PRECONDITION, "wrap() was called already: one model a job")
        self._engine = Engine(self, model)
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

    def steps(self):
        """Yields the global step numbers (0-based) still to run, across re-formations of the
        world and restores; ends when the job is over (trained, or stopped by an operator)."""
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
            if ended is not None:
                yield from ended

    def _train_generation(self, engine, needs_init):
        """Runs one generation; returns a generator of its steps (None when it ended at once)."""
        code, message = engine._attach(needs_init)
        if code:
            self._end_generation(code, message)
            return None
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
                self._end_generation(0, "")
                return
            self._loss = None
            self._failure = None
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
                return
            if boundary.value != _lib.CONTINUE:
                self._end_generation(0, "")
                return

    def _end_generation(self, code, message):
        """Hands the generation back with how it ended. The worker decides what an error means:
        the end of the generation (a peer died, the world moved on: the next begin waits for
        the next one) or of the job (the next begin raises it)."""
        self._engine._detach()
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

    def __init__(self, job, model):
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
                view = self._views[index][1]
                if param.grad is None or param.grad.data_ptr() != view.data_ptr():
                    # Raised by step(): an exception inside autograd's hooks can leave torch
                    # 1.13's graph alive in a thread-local that hangs the interpreter's exit.
                    self._misuse = (
                        f"the gradient of {self._names()[index]} is no longer Shard's buffer: "
                        "do not call zero_grad(set_to_none=True) or assign .grad (Shard zeroes "
                        "the gradients itself at every step)")
                elif self._syncing:
                    lib.shard_mark_ready(handle, index)

            if hasattr(param, "register_post_accumulate_grad_hook"):  # torch >= 2.1
                self._hooks.append(param.register_post_accumulate_grad_hook(ready))
            else:  # torch 1.13-2.0: a hook on the parameter's AccumulateGrad node
                accumulate = param.expand_as(param).grad_fn.next_functions[0][0]
                self._hooks.append(accumulate.register_hook(ready))
                self._hooks.append(accumulate)  # keeps the node, and so its hook, alive

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

    def _names(self):
        return [name for name, _ in self._model.named_parameters()]

    def _attach(self, needs_init):
        """Points the parameters at this generation's buffers, and fills them when it starts from
        scratch. Returns (code, message) of a failure that ended the generation, else (0, "")."""
        self._repoint()
        if not needs_init:
            return 0, ""
        with torch.no_grad():
            views = [param_view for param_view, _ in self._views] + self._buffer_views
            for view, initial in zip(views, self._initial):
                view.copy_(initial.reshape(view.shape))
        code = lib.shard_generation_init(self._job._handle)
        return code, (lib.shard_last_error().decode() if code else "")

    def _detach(self):
        """Gives the parameters memory of their own, holding their current values: the
        generation's buffers go away with it, and the model must stay usable (evaluated, saved)
        after training and between generations."""
        if self._layout is None:
            return
        with torch.no_grad():
            for param in self._params:
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
            param_view = _view(handle, index, False, param.shape)
            grad_view = _view(handle, index, True, param.shape) if param.requires_grad else None
            with torch.no_grad():
                param.data = param_view
                if grad_view is not None:
                    param.grad = grad_view
            views.append((param_view, grad_view))
        self._views = views
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
        """Writes the buffers into rank 0's export in their own dtype and shape (Shard holds
        them as fp32), and those it does not hold at all, so that the export loads with
        load_state_dict(strict=True)."""
        names = self._buffer_names + self._unmanaged
        if not names:
            return
        from .safetensors import load_file, metadata, save_file
        tensors = load_file(path)
        for name in names:
            tensors[name] = self._model.get_buffer(name).detach().cpu()
        save_file(tensors, path, metadata(path))

    def step(self):
        """Waits for the gradient reductions, clips, updates the part of the optimizer state this
        rank owns, and gathers the parameters. If the generation ended under it (a worker died,
        the world is resized), it returns quietly and steps() restores the newest checkpoint; any
        other failure is raised by steps() once the worker has given up the job."""
        if self._misuse is not None:
            misuse, self._misuse = self._misuse, None
            raise ShardError(_lib.FAILED_PRECONDITION, misuse)
        for index, param in enumerate(self._params):
            if param.data_ptr() != self._views[index][0].data_ptr():
                raise ShardError(
                    _lib.FAILED_PRECONDITION,
                    f"parameter {self._names()[index]} is no longer Shard's buffer: do not move "
                    "or replace the model's parameters after wrap() (model.to(), .data = ...)")
        code = lib.shard_step(self._job._handle)
        if code:
            # steps() hands the failure to the worker, which ends this generation or the job.
            self._job._failure = (code, lib.shard_last_error().decode())
            return
        self._repoint()  # the first step rebuilds the buckets in the gradients' ready order


_EXACT_IN_FP32 = (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                  torch.int16, torch.int8, torch.uint8, torch.bool)


_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_DLTENSOR = b"dltensor"  # a capsule keeps a pointer to its name: this object outlives them all


def _view(handle, index, grad, shape):
    """Tensor `index`'s values (or gradient) in Shard's memory, host or GPU, without a copy: a
    DLPack descriptor from libshard, whose deleter torch calls when the view goes."""
    managed = ctypes.c_void_p()
    check(lib.shard_tensor_dlpack(handle, index, int(grad), ctypes.byref(managed)))
    capsule = _PyCapsule_New(managed, _DLTENSOR, None)
    return torch.utils.dlpack.from_dlpack(capsule).view(shape)
