"""The training script's own torch.optim optimizer, sharded by Shard (Engine.optimizer).

    opt = engine.optimizer(torch.optim.AdamW, lr=3e-4, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    job.checkpoint_extras["scheduler"] = scheduler      # saved with every checkpoint
    for step in job.steps():
        loss_fn(model(x), y).backward()
        opt.step()                                      # reduce, your class's update, gather
        scheduler.step()

As ZeroRedundancyOptimizer(optimizer_class=...) does, the class runs on each rank over what that
rank updates: in param mode whole parameters (the model's own tensors, so shape-aware classes
such as Adafactor or Shampoo work), in range mode 1-D views of the owned ranges of the
parameters (elementwise classes only: a class whose update of a tensor is not the update of its
pieces is refused at construction). The state tensors with one value per parameter element are
views of Shard's sharded state arrays, so checkpoints and memory snapshots hold them and a
restore at any world size or in the other shard mode splits and joins them; the rest of a
parameter's state (step counts, factored moments) is handed to Shard at every save by the rank
that holds the parameter's first element, and given to every rank that updates the parameter
after a restore.
"""

import copy
import ctypes
import fnmatch
import io
import json
import warnings

import torch

from . import _lib
from ._lib import ShardError, check, lib

__all__ = ["ShardOptimizer"]

# Stand-ins for the probes that find a class's per-element state, by number of dimensions.
_PROBE_SHAPES = {1: (6,), 2: (4, 6), 3: (2, 3, 4), 4: (2, 2, 3, 2)}


# Marks a parameter's extras written by _scalar_extras rather than by torch.save (whose bytes
# start with a zip or pickle header, never with this).
_SCALARS_MAGIC = b"shard-scalar-extras-v1\n"


def dumps(value):
    """Pickles `value` (tensors included) into bytes for Shard to keep."""
    scalars = _scalar_extras(value)
    if scalars is not None:
        return scalars
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def loads(data):
    """Back from dumps(), tensors in host memory. The bytes come from this job's own checkpoints,
    checksummed, so they may hold any picklable object (a scheduler's or sampler's state)."""
    if data.startswith(_SCALARS_MAGIC):
        return _from_scalar_extras(data[len(_SCALARS_MAGIC):])
    kwargs = {"weights_only": False} if _LOAD_TAKES_WEIGHTS_ONLY else {}
    return torch.load(io.BytesIO(data), map_location="cpu", **kwargs)


def _scalar_extras(value):
    """A parameter's extras as JSON where they are only scalars, as Adam's and AdamW's step count
    is: torch.save pays for its container (about 40-120 us) at every snapshot for every
    parameter, several times the rest of a tiny model's snapshot. None where anything else is
    in them. Values come back with their exact bits (a float's repr round-trips)."""
    if not isinstance(value, dict) or set(value) != {"whole", "present"}:
        return None
    whole = {}
    for name, item in value["whole"].items():
        if not isinstance(name, str):  # JSON would hand it back as a string
            return None
        if (type(item) is torch.Tensor and item.dim() == 0 and item.device.type == "cpu"
                and not item.requires_grad and not item.is_complex() and not item.is_quantized):
            whole[name] = ["tensor", str(item.dtype).replace("torch.", ""), item.item()]
        elif type(item) in (int, float, bool):
            whole[name] = ["value", item]
        else:
            return None
    present = value["present"]
    if not isinstance(present, list) or not all(isinstance(name, str) for name in present):
        return None
    return _SCALARS_MAGIC + json.dumps({"whole": whole, "present": present}).encode()


def _from_scalar_extras(text):
    saved = json.loads(text)
    whole = {}
    for name, item in saved["whole"].items():
        if item[0] == "tensor":
            whole[name] = torch.tensor(item[2], dtype=getattr(torch, item[1]))
        else:
            whole[name] = item[1]
    return {"whole": whole, "present": saved["present"]}


def _placed(name, value, device, group):
    """A state value where torch's own load_state_dict puts it: a step count stays in host
    memory unless the group is capturable or fused, other tensors go to the parameter's device."""
    if not isinstance(value, torch.Tensor):
        return copy.deepcopy(value)
    if name == "step" and not (group.get("capturable") or group.get("fused")):
        return value.detach().to("cpu", copy=True)
    return value.detach().to(device, copy=True)


def _load_takes_weights_only():
    import inspect
    return "weights_only" in inspect.signature(torch.load).parameters


_LOAD_TAKES_WEIGHTS_ONLY = _load_takes_weights_only()


def _hyper(group):
    """A param group's settings: everything but its parameters."""
    return {key: value for key, value in group.items() if key != "params"}


def _class_name(cls):
    return f"{cls.__module__}.{cls.__qualname__}"


def _stand_in(shape, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator)


def _probe_state(optimizer_class, settings, shape):
    """The state `optimizer_class` keeps of a parameter of `shape` after two updates, or None
    when it cannot update one."""
    param = _stand_in(shape, 1)
    try:
        optimizer = optimizer_class([param], **settings)
        for seed in (2, 3):
            param.grad = _stand_in(shape, seed)
            optimizer.step()
    except Exception:  # noqa: BLE001 - any failure means: no answer for this shape
        return None
    return optimizer.state.get(param, {})


def _elementwise(optimizer_class, settings):
    """Whether `optimizer_class` updates a [4, 6] tensor exactly as it updates its two flat
    pieces (up to float rounding) over three steps whose gradients differ by row: the property
    that lets range mode run it on the ranges a rank owns. Returns (bool, why not)."""
    whole = _stand_in((4, 6), 1)
    pieces = [whole.flatten()[:10].clone(), whole.flatten()[10:].clone()]
    whole = whole.clone()
    rows = torch.tensor([1.0, 10.0, 0.1, 3.0]).unsqueeze(1)
    try:
        one, two = optimizer_class([whole], **settings), optimizer_class(pieces, **settings)
        for seed in (2, 3, 4):
            grad = _stand_in((4, 6), seed) * rows
            whole.grad = grad.clone()
            flat = grad.flatten()
            pieces[0].grad, pieces[1].grad = flat[:10].clone(), flat[10:].clone()
            one.step()
            two.step()
    except Exception as e:  # noqa: BLE001
        return False, f"it failed on 1-D pieces of a tensor: {e}"
    if not torch.allclose(whole.flatten(), torch.cat(pieces), rtol=1e-5, atol=1e-7):
        return False, "its update of a [4, 6] tensor differs from its update of the tensor's pieces"
    return True, ""


class ShardOptimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer whose step() is Shard's sharded step with the script's class as
    the update rule. `param_groups` are the model's parameters and the class's settings, as on a
    plain optimizer (an lr_scheduler changes them and the next step uses them); `state` is this
    rank's (the ranges it updates). Made by Engine.optimizer."""

    def __init__(self, engine, optimizer_class, params, defaults):
        if not (isinstance(optimizer_class, type) and
                issubclass(optimizer_class, torch.optim.Optimizer)):
            raise ShardError(_lib.INVALID_ARGUMENT,
                             f"{optimizer_class!r} is not a torch.optim.Optimizer class")
        self._engine = engine
        self._class = optimizer_class
        self._defaults = dict(defaults)
        self._range_mode = engine._job.spec.get("shard_mode", "range") != "param"
        self._local = None       # the class over this rank's ranges, for layout self._layout
        self._layout = None
        self._ranges = []        # shard_updated_ranges of that layout
        self._tensors = []       # the local optimizer's tensor for each range (None: not updated)
        self._views = []         # for each range, its state arrays' 1-D views by name
        self._restore = False    # the next build takes the state a restore read
        self._pending = None     # a state dict to load when the next generation starts afresh
        self._consolidated = None
        self._stepped_at = None  # the step this optimizer last updated (one update a step)
        groups = self._resolve_groups(params)
        try:
            full = optimizer_class([torch.zeros(1)], **self._defaults).defaults
        except TypeError as e:
            raise ShardError(_lib.INVALID_ARGUMENT,
                             f"{_class_name(optimizer_class)} does not take "
                             f"{self._defaults}: {e}") from e
        self._constructing = True
        super().__init__(groups, full)
        self._constructing = False
        self.state_names = self._probe_state_names()
        check(lib.shard_job_set_optimizer(engine._job._handle, json.dumps(
            {"class": _class_name(optimizer_class), "state": self.state_names}).encode()))

    # --- construction ---------------------------------------------------------------------------

    def _resolve_groups(self, params):
        """torch-style groups over the model's parameters: `params` None (every trainable
        parameter), parameters, or dicts whose "params" are parameters or fnmatch patterns over
        the model's names (a pattern takes the trainable parameters no earlier group took)."""
        named = [(name, p) for name, p in self._engine._named_params() if p.requires_grad]
        if params is None:
            return [{"params": [p for _, p in named]}]
        if isinstance(params, torch.Tensor):
            raise TypeError("params must be an iterable of parameters or of dicts (param groups), "
                            "as for torch.optim")
        params = list(params)
        if not params or not isinstance(params[0], dict):
            params = [{"params": params}]
        model = {id(p) for _, p in self._engine._named_params()}
        taken, groups = set(), []
        for index, group in enumerate(params):
            group = dict(group)
            wanted = group.get("params")
            if isinstance(wanted, (str, torch.Tensor)):
                wanted = [wanted]
            chosen = []
            for item in wanted or []:
                if isinstance(item, str):
                    matched = [p for name, p in named
                               if fnmatch.fnmatchcase(name, item) and id(p) not in taken]
                    chosen += matched
                    taken.update(id(p) for p in matched)
                elif isinstance(item, torch.Tensor):
                    if id(item) not in model:
                        raise ShardError(_lib.INVALID_ARGUMENT,
                                         f"param group {index} holds a tensor that is not a "
                                         "parameter of the wrapped model")
                    if id(item) in taken:
                        raise ValueError("some parameters appear in more than one parameter group")
                    chosen.append(item)
                    taken.add(id(item))
                else:
                    raise TypeError(f"param group {index}: 'params' holds {type(item).__name__}; "
                                    "give parameters or name patterns such as '*.bias'")
            if not chosen:
                raise ShardError(_lib.INVALID_ARGUMENT,
                                 f"param group {index} ({group.get('params')!r}) takes no "
                                 "parameter: a typo in a pattern, or every match went to an "
                                 "earlier group")
            group["params"] = chosen
            groups.append(group)
        left = [name for name, p in named if id(p) not in taken]
        if left:
            warnings.warn(f"shard.torch: the optimizer updates no parameter of "
                          f"{', '.join(left[:4])}{' ...' if len(left) > 4 else ''} (in no param "
                          "group): they stay as they are, as with a plain torch optimizer",
                          stacklevel=4)
        return groups

    def _probe_state_names(self):
        """The names of the class's state tensors that hold one value per parameter element,
        found by updating small stand-ins with each group's settings: Shard keeps those sharded.
        In range mode the class must be elementwise (ShardError naming param mode otherwise)."""
        names = []
        for group in self.param_groups:
            settings = {key: value for key, value in group.items() if key in self.defaults}
            if self._range_mode:
                ok, why = _elementwise(self._class, settings)
                if not ok:
                    raise ShardError(
                        _lib.INVALID_ARGUMENT,
                        f"{_class_name(self._class)} cannot run in range mode: {why}. Range mode "
                        "updates 1-D ranges of the parameters; use param mode (\"shardMode\": "
                        "\"param\" in the job spec), where each rank updates whole parameters")
                shapes = [_PROBE_SHAPES[1]]
            else:
                shapes = sorted({_PROBE_SHAPES.get(p.dim(), (2,) * p.dim())
                                 for p in group["params"] if p.dim() > 0})
            for shape in shapes:
                state = _probe_state(self._class, settings, shape) or {}
                for name, value in state.items():
                    if (isinstance(value, torch.Tensor) and value.dtype == torch.float32 and
                            tuple(value.shape) == tuple(shape) and name not in names):
                        names.append(name)
        return names

    def add_param_group(self, param_group):
        if not getattr(self, "_constructing", False):
            raise ShardError(_lib.FAILED_PRECONDITION,
                             "a Shard optimizer's param groups are fixed once it is made: give "
                             "every group to engine.optimizer(cls, groups)")
        super().add_param_group(param_group)

    # torch's Optimizer.__init__ assigns self.state; reading it gives this rank's state.
    @property
    def state(self):
        return self._local.state if self._local is not None else self._empty_state

    @state.setter
    def state(self, value):
        self._empty_state = value

    # --- one generation's local optimizer -------------------------------------------------------

    def _on_generation(self, restored):
        """A generation began: the local optimizer is built on its layout now with the state its
        restore read (`restored`), or else at the first update (after the first step's bucket
        rebuild), fresh or with a pending load_state_dict's state."""
        self._local = None
        self._layout = None
        self._restore = restored
        if restored:
            self._pending = None  # the job's own checkpoint is newer than what was loaded
            self._ensure_local()

    def _detach(self):
        """The generation's memory goes away: the state keeps copies of its values."""
        if self._local is None:
            return
        with torch.no_grad():
            for tensor in self._tensors:
                if tensor is None:
                    continue
                for name, value in self._local.state.get(tensor, {}).items():
                    if isinstance(value, torch.Tensor):
                        self._local.state[tensor][name] = value.clone()
                if not isinstance(tensor, torch.nn.Parameter):
                    tensor.data = tensor.data.clone()
                    tensor.grad = None
        self._views = []
        self._layout = None

    def _ensure_local(self):
        """Builds the local optimizer over the ranges of the current layout (again after the
        first step's bucket rebuild moved them)."""
        job = self._engine._job
        version = ctypes.c_int64()
        check(lib.shard_layout_version(job._handle, ctypes.byref(version)))
        if self._local is not None and self._layout == version.value:
            return
        text = ctypes.c_char_p()
        check(lib.shard_updated_ranges(job._handle, ctypes.byref(text)))
        self._ranges = json.loads(text.value)
        params = self._engine._params
        group_of = {id(p): g for g, group in enumerate(self.param_groups) for p in group["params"]}
        local_groups = [dict(_hyper(group), params=[]) for group in self.param_groups]
        self._tensors, self._views, self._whole = [], [], []
        for index, piece in enumerate(self._ranges):
            param = params[piece["param"]]
            group = group_of.get(id(param))
            self._views.append({name: self._engine._range_view(index, k)
                                for k, name in enumerate(self.state_names)})
            whole = piece["offset"] == 0 and piece["numel"] == param.numel()
            self._whole.append(whole)
            if group is None:
                self._tensors.append(None)
                continue
            if whole and self._engine._units is None:
                tensor = param  # the model's own parameter, its shape and gradient
            else:
                # A piece, or at ZeRO stage 3 (where the parameter is not whole between steps)
                # the owned copy in the parameter's shape.
                shape = param.shape if whole else (piece["numel"],)
                tensor = self._engine._range_view(index, -1).view(shape)
                tensor.grad = self._engine._range_view(index, -2).view(shape)
            self._tensors.append(tensor)
            local_groups[group]["params"].append(tensor)
        self._local = self._class(local_groups, **self._defaults)
        # By range: the state values _adopt_state last saw (it has nothing to do until the class
        # adds or replaces one).
        self._adopted = [None] * len(self._tensors)
        self._layout = version.value
        if self._restore:
            self._restore = False
            self._load_restored()

    def _whole_param(self, index):
        return self._whole[index]

    def _load_restored(self):
        """The state a restore read: each range's per-element state from Shard's arrays, the rest
        from the extras of its parameter."""
        for index, tensor in enumerate(self._tensors):
            if tensor is None:
                continue
            data = self._engine._restored_extra(self._ranges[index]["param"])
            if data is None:
                continue  # never updated before the checkpoint
            saved = loads(data)
            group = self._local.param_groups[0]  # placement settings are the class's own
            state = {name: _placed(name, value, self._engine._device, group)
                     for name, value in saved["whole"].items()}
            if not self._whole_param(index):
                param = self._engine._params[self._ranges[index]["param"]]
                for name, value in state.items():
                    if isinstance(value, torch.Tensor) and value.numel() == param.numel() > 1:
                        raise ShardError(
                            _lib.FAILED_PRECONDITION,
                            f"the checkpoint keeps state '{name}' of "
                            f"{self._engine._names()[self._ranges[index]['param']]} whole, one "
                            "value per element: range mode cannot split it (restore in param "
                            "mode)")
            for name in saved["present"]:
                state[name] = self._views[index][name].view(tensor.shape)
            self._local.state[tensor] = state

    def _adopt_state(self):
        """After an update: per-element state the class made anew (its first update makes it)
        moves into Shard's arrays, and the class goes on updating it there."""
        for index, tensor in enumerate(self._tensors):
            if tensor is None:
                continue
            state = self._local.state.get(tensor)
            if not state:
                continue
            seen = self._adopted[index]
            if (seen is not None and len(seen) == len(state) and
                    all(value is before for value, before in zip(state.values(), seen))):
                continue
            views = self._views[index]
            for name, view in views.items():
                value = state.get(name)
                if (not isinstance(value, torch.Tensor) or value.data_ptr() == view.data_ptr() or
                        value.dtype != torch.float32 or value.shape != tensor.shape):
                    continue
                with torch.no_grad():
                    view.copy_(value.reshape(-1))
                state[name] = view.view(tensor.shape)
            if not self._whole_param(index):
                for name, value in state.items():
                    if (name not in views and isinstance(value, torch.Tensor) and
                            value.shape == tensor.shape and value.numel() > 1):
                        raise ShardError(
                            _lib.FAILED_PRECONDITION,
                            f"{_class_name(self._class)} made per-element state '{name}' that "
                            "its probe did not show: range mode cannot shard it (use param mode)")
            self._adopted[index] = tuple(state.values())

    def _sync_settings(self, source, target):
        for source_group, target_group in zip(source, target):
            target_group.update(_hyper(source_group))

    def _update(self):
        """This rank's update with the script's class, between Shard's reduction and gather."""
        self._ensure_local()
        if self._pending is not None:  # now on the final layout
            pending, self._pending = self._pending, None
            self._load_full(pending)
        self._sync_settings(self.param_groups, self._local.param_groups)
        self._local.step()
        self._sync_settings(self._local.param_groups, self.param_groups)
        self._adopt_state()

    # --- what saves hand to Shard ---------------------------------------------------------------

    def _whole_state(self, index):
        """A range's state that is not in Shard's arrays, and the names of what is: what its
        parameter's extras hold. None before the class's first update of it."""
        state = self._local.state.get(self._tensors[index]) if self._local is not None else None
        if not state:
            return None
        views = self._views[index]
        present = [name for name, view in views.items()
                   if isinstance(state.get(name), torch.Tensor) and
                   state[name].data_ptr() == view.data_ptr()]
        whole = {name: value for name, value in state.items() if name not in present}
        return {"whole": whole, "present": present}

    def _put_extras(self, put):
        """At a save: the extras of the parameters whose first element this rank holds."""
        for index, tensor in enumerate(self._tensors):
            if tensor is None or not self._ranges[index]["extras"]:
                continue
            saved = self._whole_state(index)
            if saved is not None:
                put(self._ranges[index]["param"], dumps(saved))

    def _consolidate(self, to):
        """The whole state as a torch state_dict on rank `to` (None elsewhere), one parameter at
        a time (Engine.consolidated_state_dict)."""
        self._ensure_local()
        engine = self._engine
        index_of = {id(p): i for i, p in enumerate(engine._params)}
        holder = {piece["param"]: index for index, piece in enumerate(self._ranges)
                  if piece["extras"] and self._tensors[index] is not None}
        state, groups, position = {}, [], 0
        for group in self.param_groups:
            positions = []
            for param in group["params"]:
                positions.append(position)
                if param.requires_grad:
                    number = index_of[id(param)]
                    index = holder.get(number)
                    whole = self._whole_state(index) if index is not None else None
                    saved = engine._gather_extra(number, to, dumps(whole) if whole else b"")
                    arrays = engine._gather_arrays(number, to, len(self.state_names))
                    if saved:  # rank `to`, and the parameter has state
                        saved = loads(saved)
                        state[position] = dict(saved["whole"])
                        for name in saved["present"]:
                            state[position][name] = arrays[self.state_names.index(name)]
                position += 1
            groups.append(dict(_hyper(group), params=positions))
        return {"state": state, "param_groups": groups} if engine._job.rank == to else None

    def _job_state(self):
        return [_hyper(group) for group in self.param_groups]

    def _load_job_state(self, settings):
        if len(settings) != len(self.param_groups):
            raise ShardError(_lib.FAILED_PRECONDITION,
                             f"the checkpoint's optimizer has {len(settings)} param groups, this "
                             f"one {len(self.param_groups)}")
        for group, saved in zip(self.param_groups, settings):
            group.update(saved)

    # --- torch.optim.Optimizer ------------------------------------------------------------------

    def step(self, closure=None):
        """Shard's step: waits for the gradient reductions, clips (the job's gradClipNorm), runs
        the class's update on what this rank updates, and gathers the parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._engine._torch_step(self)
        return loss

    def zero_grad(self, set_to_none=True):
        """Nothing to do: the gradients are views of Shard's buckets, which Shard zeroes at the
        start of every step, whatever `set_to_none` says."""

    def consolidate_state_dict(self, to=0):
        """Collective (every rank calls it): rank `to` gathers the whole optimizer state, which
        its state_dict() then returns (ZeroRedundancyOptimizer's consolidate_state_dict)."""
        self._consolidated = self._engine.consolidated_state_dict(to, model=False)

    def state_dict(self):
        """The whole state as a plain torch optimizer's state_dict, on the rank that ran
        consolidate_state_dict(to=...) last; loads into a plain optimizer of the same class over
        the same groups, or back into this one."""
        if self._consolidated is None:
            raise RuntimeError("Optimizer state has not been consolidated on this rank. Call "
                               "consolidate_state_dict(to=...) on all ranks first (a Shard "
                               "optimizer's state is sharded over the ranks)")
        return self._consolidated["optimizer"]

    def load_state_dict(self, state_dict):
        """Loads a whole torch optimizer state_dict (a plain optimizer's of the same class and
        groups, or a consolidated one) on every rank: each keeps what it updates. Before
        job.steps() it is applied when training starts afresh; a checkpoint restored instead is
        newer and wins."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
                len(saved["params"]) != len(group["params"])
                for saved, group in zip(saved_groups, self.param_groups)):
            raise ValueError("loaded state dict has a different number of parameter groups or "
                             "of parameters in a group")
        by_param = {}
        for saved, group in zip(saved_groups, self.param_groups):
            group.update(_hyper(saved))
            for index, param in zip(saved["params"], group["params"]):
                if index in state_dict["state"]:
                    by_param[id(param)] = state_dict["state"][index]
        # Inside the loop it applies now; otherwise when the next update builds the optimizer.
        if self._local is not None and self._layout is not None and self._stepped_at is not None:
            self._load_full(by_param)
        else:
            self._pending = by_param

    def _load_full(self, by_param):
        """Each range's part of whole per-parameter state (`by_param`: id(param) -> state)."""
        device = self._engine._device
        params = self._engine._params
        with torch.no_grad():
            for index, tensor in enumerate(self._tensors):
                if tensor is None:
                    continue
                param = params[self._ranges[index]["param"]]
                saved = by_param.get(id(param))
                if saved is None:
                    self._local.state.pop(tensor, None)
                    continue
                begin = self._ranges[index]["offset"]
                end = begin + self._ranges[index]["numel"]
                state = {}
                for name, value in saved.items():
                    if (isinstance(value, torch.Tensor) and value.is_floating_point() and
                            value.shape == param.shape):
                        piece = value.reshape(-1)[begin:end].to(device=device, dtype=torch.float32)
                        view = self._views[index].get(name)
                        if view is not None:
                            view.copy_(piece)
                            state[name] = view.view(tensor.shape)
                        else:
                            state[name] = piece.clone().view(tensor.shape)
                    else:
                        state[name] = _placed(name, value, device, self._local.param_groups[0])
                self._local.state[tensor] = state
