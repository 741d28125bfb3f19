"""ZeRO stage 3 for a torch module (shard.torch's Engine at "zeroStage": 3): each rank keeps only its
shard of the trainable parameters, and a unit's parameters are gathered while the unit computes.

A unit is a module (Job.wrap's `units`): its parameters are those of its subtree outside any
nested unit, shared (tied) ones included wherever they are used. Shard's engine gathers whole
buckets of its plan, so a unit acquires every bucket that holds one of its parameters:

- forward: a pre-hook acquires the unit's buckets and points each parameter's `.data` at its
  place in the gathered bucket; the forward hook releases them and points `.data` back at a
  placeholder of the right shape that holds no memory (one float, expanded). A unit called
  twice in one forward acquires twice.
- backward: what autograd saves of a gathered bucket (a weight, its transpose) is saved as
  (bucket, offset, size, stride) by a saved-tensors pack hook (on from the step's start to its
  update), not as memory, so the bucket's
  slot can serve another bucket meanwhile; the unpack hook gathers the bucket again when
  backward needs it (the engine prefetches in the order the previous step acquired), and it is
  released once every trainable parameter of the bucket has its gradient. The outermost unit
  (the model) stays gathered from its forward to its backward, as FSDP keeps its root. torch 1.13 has no
  module backward pre-hook; this needs none.
- gradients: autograd makes each parameter's gradient as usual; once it is complete (the
  gradient-ready hook) it is copied into the bucket's gradient buffer, `.grad` is set back to
  None and the bucket reduce-scatters to the owners when its last gradient is in. Inside
  no_sync() gradients stay in `.grad` and accumulate (whole, as FSDP's no_sync keeps them).
"""

import collections
import ctypes
import json

import torch
import torch.utils.dlpack

from . import _lib
from ._lib import ShardError, check, lib

_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict)


def choose_units(model, units, min_params):
    """The unit modules of `model`, the root last. `units`: None or an int (FSDP's size-based
    policy: a module whose parameters not yet in a unit number at least that many, default
    `min_params`, becomes one; ModuleList and ModuleDict never do), a module class or tuple of
    classes (every instance), or a list of submodules."""
    chosen = []
    if units is None or isinstance(units, int):
        threshold = units if units is not None else min_params

        def visit(module):
            remaining = sum(p.numel() for p in module._parameters.values() if p is not None)
            for child in module.children():
                remaining += visit(child)
            if module is not model and remaining >= threshold and \
                    not isinstance(module, _CONTAINERS):
                chosen.append(module)
                return 0
            return remaining

        visit(model)
    elif isinstance(units, type) or (isinstance(units, tuple) and
                                     all(isinstance(u, type) for u in units)):
        chosen = [m for m in model.modules() if isinstance(m, units) and m is not model]
    else:
        members = {id(m) for m in model.modules()}
        for module in units:
            if not isinstance(module, torch.nn.Module) or id(module) not in members:
                raise ShardError(_lib.INVALID_ARGUMENT,
                                 f"units: {type(module).__name__} is not a submodule of the "
                                 "wrapped model (pass submodules, a module class, or a number "
                                 "of parameters)")
            if module is not model:
                chosen.append(module)
    return chosen + [model]


class _Saved:
    """A saved tensor that lived in a gathered bucket: where in the bucket, not the memory."""
    __slots__ = ("bucket", "offset", "size", "stride")

    def __init__(self, bucket, offset, size, stride):
        self.bucket, self.offset, self.size, self.stride = bucket, offset, size, stride


class Units:
    """The hooks and bookkeeping of stage 3 for one wrapped model (see the module docstring)."""

    def __init__(self, engine, model, params, units, min_params):
        self._engine = engine
        self._params = params
        self._shapes = [p.shape for p in params]  # .data changes; the shapes stay
        self._modules = choose_units(model, units, min_params)
        index_of = {id(p): i for i, p in enumerate(params) if p.requires_grad}
        unit_ids = {id(m) for m in self._modules}
        self._members = []  # by unit: its trainable parameters' indices
        for unit in self._modules:
            found, stack = [], [unit]
            while stack:
                module = stack.pop()
                for p in module._parameters.values():
                    if p is not None and id(p) in index_of and index_of[id(p)] not in found:
                        found.append(index_of[id(p)])
                stack.extend(c for c in reversed(list(module.children()))
                             if id(c) not in unit_ids)
            self._members.append(found)
        # NaN: a parameter read outside its unit shows in the results, not as stale values.
        self._placeholder = torch.full((1,), float("nan"), device=engine._device)
        self.active = False  # while a generation trains
        self._layout = None
        self._gathered = {}  # bucket -> 1-D view of its whole parameters
        self._holds = collections.Counter()
        self._backward = set()  # buckets held for backward (the root's, the unpack hook's)
        self._grads = {}  # bucket -> 1-D view of its gradient buffer, this step
        self._left = {}  # bucket -> gradients still to come in this backward
        self._saved_hooks = None
        self._hooks = []
        for u, unit in enumerate(self._modules):
            self._hooks.append(unit.register_forward_pre_hook(
                lambda module, args, u=u: self._enter(u)))
            self._hooks.append(unit.register_forward_hook(
                lambda module, args, out, u=u: self._leave(u)))

    @property
    def handle(self):
        return self._engine._job._handle

    # Layout: where each trainable parameter lives (it changes at the first step's rebuild).

    def load_layout(self, version):
        """Reads the engine's bucket layout when it changed, and points every trainable
        parameter at its placeholder."""
        if version != self._layout:
            text = ctypes.c_char_p()
            check(lib.shard_param_layout(self.handle, ctypes.byref(text)))
            layout = json.loads(text.value)
            self._place = {i: (b, o) for i, (b, o) in enumerate(layout["params"]) if b >= 0}
            self._bucket_params = collections.defaultdict(list)
            for index, (bucket, _) in self._place.items():
                self._bucket_params[bucket].append(index)
            self._unit_buckets = [sorted({self._place[i][0] for i in members})
                                  for members in self._members]
            self._layout = version
        self._gathered.clear()
        self._holds.clear()
        self._backward.clear()
        self.point_at_placeholders()

    def begin_step(self):
        """The saved-tensors hooks stay on from here to the update, so that a parameter used
        outside its units' forward (in the loss) is found too."""
        self._grads.clear()
        self._left = {b: len(indices) for b, indices in self._bucket_params.items()}
        self._stop_saving()
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._saved_hooks.__enter__()

    def _stop_saving(self):
        if self._saved_hooks is not None:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks = None

    def end_step(self):
        """Before the step's update: nothing may stay acquired (a parameter that got no
        gradient leaves its bucket held by backward)."""
        self._stop_saving()
        for bucket in list(self._backward):
            self._drop_hold(bucket)
        self._backward.clear()
        self._grads.clear()

    def _point_at_placeholder(self, index):
        self._params[index].data = self._placeholder.expand(self._shapes[index])

    def point_at_placeholders(self):
        """Between generations: no rank holds a trainable parameter whole."""
        with torch.no_grad():
            for index in self._place:
                self._point_at_placeholder(index)

    # Gathering.

    def _ok(self, code):
        """A libshard call from a hook: its failure (a peer died, the world moved on) is kept for
        engine.step(), which then ends the step quietly, as with shard_step's own failures; the
        hook goes on over placeholders (NaN) meanwhile. Returns whether the call succeeded."""
        if code == 0:
            return True
        job = self._engine._job
        if job._failure is None:
            job._failure = (code, lib.shard_last_error().decode())
        return False

    def _acquire(self, bucket):
        """Gathers `bucket` and points its parameters at it; None if that failed."""
        managed = ctypes.c_void_p()
        if not self._ok(lib.shard_acquire(self.handle, bucket, 0, ctypes.byref(managed))):
            return None
        view = from_dlpack(managed)
        previous = self._gathered.get(bucket)
        self._gathered[bucket] = view
        self._holds[bucket] += 1
        if previous is None or previous.data_ptr() != view.data_ptr():
            with torch.no_grad():
                for index in self._bucket_params[bucket]:
                    offset, shape = self._place[index][1], self._shapes[index]
                    self._params[index].data = view[offset:offset + shape.numel()].view(shape)
        return view

    def _drop_hold(self, bucket):
        self._ok(lib.shard_release(self.handle, bucket))
        self._holds[bucket] -= 1
        if self._holds[bucket] <= 0:
            del self._holds[bucket]
            self._gathered.pop(bucket, None)
            with torch.no_grad():
                for index in self._bucket_params[bucket]:
                    self._point_at_placeholder(index)

    def _enter(self, unit):
        if not self.active:
            return
        for bucket in self._unit_buckets[unit]:
            self._acquire(bucket)

    def _leave(self, unit):
        if not self.active:
            return
        # The outermost unit stays gathered for backward, which begins with it (FSDP does not
        # reshard the root after forward either); backward releases it bucket by bucket.
        keep = unit == len(self._modules) - 1 and torch.is_grad_enabled()
        for bucket in self._unit_buckets[unit]:
            if keep and bucket not in self._backward:
                self._backward.add(bucket)
            else:
                self._drop_hold(bucket)

    def _pack(self, tensor):
        if tensor.device != self._placeholder.device or tensor.numel() == 0:
            return tensor
        pointer = tensor.data_ptr()
        if pointer == self._placeholder.data_ptr():
            if self._engine._job._failure is not None:  # a failed gather: the step is lost
                return tensor
            raise ShardError(_lib.FAILED_PRECONDITION,
                             "a parameter was used outside the forward of the unit that holds it: "
                             "at ZeRO stage 3 a parameter is whole only inside its unit's "
                             "forward (pass the module that uses it in wrap(model, units=...))")
        for bucket, view in self._gathered.items():
            start = view.data_ptr()
            if start <= pointer < start + view.numel() * view.element_size():
                return _Saved(bucket, (pointer - start) // view.element_size(),
                              tuple(tensor.size()), tuple(tensor.stride()))
        return tensor

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        if saved.bucket not in self._backward:
            if self._acquire(saved.bucket) is None:
                return self._placeholder.expand(saved.size)
            self._backward.add(saved.bucket)
        return torch.as_strided(self._gathered[saved.bucket], saved.size, saved.stride,
                                saved.offset)

    # Gradients.

    def gradient_ready(self, index, syncing):
        """Autograd completed parameter `index`'s gradient in `.grad`. Returns what is wrong, or
        None. Runs inside autograd: it must not raise."""
        param = self._params[index]
        bucket, offset = self._place[index]
        if syncing:
            if param.grad is None:
                return (f"the gradient of {self._engine._names()[index]} is gone: do not set "
                        ".grad to None during backward")
            grads = self._grads.get(bucket)
            if grads is None:
                managed = ctypes.c_void_p()
                if self._ok(lib.shard_acquire(self.handle, bucket, 1, ctypes.byref(managed))):
                    grads = self._grads[bucket] = from_dlpack(managed)
            if grads is not None:
                with torch.no_grad():
                    grads[offset:offset + param.numel()].copy_(param.grad.reshape(-1))
                lib.shard_mark_ready(self.handle, index)
            param.grad = None
        self._left[bucket] -= 1
        if self._left[bucket] == 0:
            self._left[bucket] = len(self._bucket_params[bucket])
            self._grads.pop(bucket, None)
            if bucket in self._backward:
                self._backward.discard(bucket)
                self._drop_hold(bucket)
        return None

    # Whole values, collectively (every rank in the same order).

    def gather_all(self):
        """Gives every trainable parameter memory of its own holding its whole value. Returns
        False if a gather failed (a peer died as the job ended): the rest stay placeholders."""
        with torch.no_grad():
            for bucket in sorted(self._bucket_params):
                view = self._acquire(bucket)
                if view is None:
                    return False
                values = {}
                for index in self._bucket_params[bucket]:
                    offset, shape = self._place[index][1], self._shapes[index]
                    values[index] = view[offset:offset + shape.numel()].view(shape).clone()
                self._drop_hold(bucket)
                for index, value in values.items():
                    self._params[index].data = value
        return True

    def set_initial(self, index, values):
        host = values.detach().to("cpu", torch.float32).contiguous()
        check(lib.shard_set_initial(self.handle, index, host.data_ptr()))


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32),
                ("device_id", ctypes.c_int32), ("ndim", ctypes.c_int32),
                ("dtype_code", ctypes.c_uint8), ("dtype_bits", ctypes.c_uint8),
                ("dtype_lanes", ctypes.c_uint16), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    """dlpack/dlpack.h's DLManagedTensor (DLPack 0.6), as libshard hands it out."""


DLManagedTensor._fields_ = [
    ("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
    ("deleter", ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor)))]

# Prototypes of our own (ctypes.pythonapi's functions are shared with every other module). The
# capsule is passed as a plain pointer: the destructor runs while it is being freed, when a
# new reference would bring it back.
_api = ctypes.pythonapi
_PyCapsule_New = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p,
                                   ctypes.c_void_p)(("PyCapsule_New", _api))
_PyCapsule_IsValid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", _api))
_PyCapsule_GetPointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", _api))
_DLTENSOR = b"dltensor"


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _delete_unconsumed(capsule):
    """The DLPack capsule's destructor: a consumer that took the descriptor renamed the capsule
    ("used_dltensor") and calls its deleter itself; otherwise nobody will, so this does."""
    if _PyCapsule_IsValid(capsule, _DLTENSOR):
        managed = ctypes.cast(_PyCapsule_GetPointer(capsule, _DLTENSOR),
                              ctypes.POINTER(DLManagedTensor))
        if managed.contents.deleter:
            managed.contents.deleter(managed)


_DELETE_UNCONSUMED = ctypes.cast(_delete_unconsumed, ctypes.c_void_p)


def _dlpack_capsule(managed):
    """A "dltensor" capsule that owns `managed` (a DLManagedTensor*) until a consumer such as
    torch.utils.dlpack.from_dlpack takes it; dropped unconsumed, it calls the deleter."""
    return _PyCapsule_New(managed, _DLTENSOR, _DELETE_UNCONSUMED)


def from_dlpack(managed):
    """A torch tensor over a DLPack descriptor from libshard, whose deleter torch calls when the
    tensor goes (or this, if torch refuses it)."""
    capsule = _dlpack_capsule(managed)
    try:
        return torch.utils.dlpack.from_dlpack(capsule)
    finally:
        # Dropped here, not while an exception propagates: ctypes cannot run the destructor
        # while one is pending.
        del capsule
