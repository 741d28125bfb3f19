// Element-wise reductions of host buffers, for the CPU collectives.
#pragma once

#include <cstddef>

#include "common/dtype.h"
#include "worker/dataplane/communicator.h"

namespace shard {

// dst[i] = a[i] op b[i] for i < count; dst may alias a or b. 16-bit floats are reduced in
// float and rounded back (to nearest even), as NCCL does.
void ReduceBuffers(DataType dtype, ReduceOp op, void* dst, const void* a, const void* b,
                   size_t count);

}  // namespace shard
