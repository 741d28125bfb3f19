"""Shard: sharded data-parallel training with elastic recovery, for any training loop.

`shard.torch` puts a PyTorch training loop on a Shard coordinator (see its docstring); this
package is pure Python over libshard, the worker as a C library, so it works with any torch
version. Errors from the worker are raised as ShardError with the worker's message.
"""

from ._lib import ShardError

__all__ = ["ShardError"]
