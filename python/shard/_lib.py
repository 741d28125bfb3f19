"""ctypes bindings of libshard (capi/shard.h): the library next to this file, or SHARD_LIBRARY."""

import ctypes
import os

# absl's status codes, as libshard returns them.
CANCELLED = 1
INVALID_ARGUMENT = 3
FAILED_PRECONDITION = 9
ABORTED = 10

CONTINUE, PAUSED, FINISHED = 0, 1, 2

# shard_set_extras_callback's callback: int (*)(void* context).
EXTRAS_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


class ShardError(RuntimeError):
    """A failed libshard call: `code` is absl's status code, the message says what to do."""

    def __init__(self, code, message):
        super().__init__(message)
        self.code = code


def _load():
    path = os.environ.get("SHARD_LIBRARY") or os.path.join(os.path.dirname(__file__), "libshard.so")
    if not os.path.exists(path):
        raise ImportError(
            f"libshard not found at {path}: build Shard (scripts/build.sh) and put build/python on "
            "PYTHONPATH, install it (cmake --install), or set SHARD_LIBRARY")
    lib = ctypes.CDLL(path)  # CDLL releases the GIL during every call
    job = ctypes.c_void_p
    signatures = {
        "shard_last_error": ([], ctypes.c_char_p),
        "shard_join": ([ctypes.c_char_p, ctypes.POINTER(job)], ctypes.c_int),
        "shard_job_info": ([job, ctypes.POINTER(ctypes.c_char_p)], ctypes.c_int),
        "shard_job_set_model": ([job, ctypes.c_char_p], ctypes.c_int),
        "shard_job_set_optimizer": ([job, ctypes.c_char_p], ctypes.c_int),
        "shard_generation_begin": ([job, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)],
                                   ctypes.c_int),
        "shard_generation_init": ([job], ctypes.c_int),
        "shard_layout_version": ([job, ctypes.POINTER(ctypes.c_int64)], ctypes.c_int),
        "shard_tensor_dlpack": ([job, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)],
                                ctypes.c_int),
        "shard_param_layout": ([job, ctypes.POINTER(ctypes.c_char_p)], ctypes.c_int),
        "shard_acquire": ([job, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)],
                          ctypes.c_int),
        "shard_release": ([job, ctypes.c_int], ctypes.c_int),
        "shard_set_initial": ([job, ctypes.c_int, ctypes.c_void_p], ctypes.c_int),
        "shard_set_stream": ([job, ctypes.c_size_t], ctypes.c_int),
        "shard_broadcast": ([job, ctypes.c_int], ctypes.c_int),
        "shard_step_begin": ([job, ctypes.POINTER(ctypes.c_int64)], ctypes.c_int),
        "shard_mark_ready": ([job, ctypes.c_int], None),
        "shard_mark_bucket_ready": ([job, ctypes.c_int], None),
        "shard_step": ([job], ctypes.c_int),
        "shard_step_reduce": ([job, ctypes.POINTER(ctypes.c_int)], ctypes.c_int),
        "shard_step_finish": ([job, ctypes.c_int], ctypes.c_int),
        "shard_updated_ranges": ([job, ctypes.POINTER(ctypes.c_char_p)], ctypes.c_int),
        "shard_range_dlpack": ([job, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)],
                               ctypes.c_int),
        "shard_set_extras_callback": ([job, EXTRAS_CALLBACK, ctypes.c_void_p], ctypes.c_int),
        "shard_put_extra": ([job, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t], ctypes.c_int),
        "shard_restored_extra": ([job, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p),
                                  ctypes.POINTER(ctypes.c_size_t)], ctypes.c_int),
        "shard_gather_to_rank": ([job, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p],
                                 ctypes.c_int),
        "shard_gather_extra": ([job, ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t,
                                ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)],
                               ctypes.c_int),
        "shard_step_end": ([job, ctypes.c_double, ctypes.POINTER(ctypes.c_int)], ctypes.c_int),
        "shard_generation_end": ([job, ctypes.c_int, ctypes.c_char_p,
                                  ctypes.POINTER(ctypes.c_char_p)], ctypes.c_int),
        "shard_job_close": ([job], None),
    }
    for name, (argtypes, restype) in signatures.items():
        function = getattr(lib, name)
        function.argtypes = argtypes
        function.restype = restype
    return lib


lib = _load()


def check(code):
    """Raises ShardError for a failed call's code."""
    if code != 0:
        raise ShardError(code, lib.shard_last_error().decode("utf-8", "replace"))
