"""The DLPack descriptors libshard hands out reach torch in a "dltensor" capsule
(shard.units.from_dlpack) that owns the descriptor until torch takes it: its deleter runs exactly
once, when the tensor goes, or when the capsule goes unconsumed (torch refused the descriptor, or
nothing took it). Descriptors made here over torch's memory stand in for libshard's."""

import ctypes

import pytest
import torch

from shard import units

DELETER = dict(units.DLManagedTensor._fields_)["deleter"]


class Descriptor:
    """A DLManagedTensor over `values` (fp32, 1-D) whose deleter counts its calls."""

    def __init__(self, values, dtype_bits=32):
        self.values = values
        self.shape = (ctypes.c_int64 * 1)(values.numel())
        self.deleted = 0
        self.deleter = DELETER(self._delete)  # kept alive as long as the descriptor
        self.managed = units.DLManagedTensor()
        tensor = self.managed.dl_tensor
        tensor.data = values.data_ptr()
        tensor.device_type = 1  # kDLCPU
        tensor.ndim = 1
        tensor.dtype_code, tensor.dtype_bits, tensor.dtype_lanes = 2, dtype_bits, 1  # kDLFloat
        tensor.shape = self.shape
        self.managed.deleter = self.deleter

    def _delete(self, managed):
        assert ctypes.addressof(managed.contents) == self.pointer.value
        self.deleted += 1

    @property
    def pointer(self):
        return ctypes.c_void_p(ctypes.addressof(self.managed))


def test_a_consumed_descriptor_is_deleted_once_when_the_tensor_goes():
    descriptor = Descriptor(torch.arange(5, dtype=torch.float32))
    tensor = units.from_dlpack(descriptor.pointer)
    assert torch.equal(tensor, descriptor.values)
    assert tensor.data_ptr() == descriptor.values.data_ptr()
    assert descriptor.deleted == 0  # the capsule went, torch holds the descriptor
    del tensor
    assert descriptor.deleted == 1


def test_a_descriptor_torch_refuses_is_deleted_by_its_capsule():
    descriptor = Descriptor(torch.zeros(4), dtype_bits=24)  # no such float
    with pytest.raises(RuntimeError):
        units.from_dlpack(descriptor.pointer)
    assert descriptor.deleted == 1


def test_a_capsule_dropped_unconsumed_deletes_its_descriptor():
    descriptor = Descriptor(torch.zeros(3))
    capsule = units._dlpack_capsule(descriptor.pointer)
    assert descriptor.deleted == 0
    del capsule
    assert descriptor.deleted == 1
