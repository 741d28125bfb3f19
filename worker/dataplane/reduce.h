// Element-wise reductions of host buffers, and how a buffer splits into the ranks' blocks, for
// the CPU collectives.
#pragma once

#include <cstddef>
#include <vector>

#include "common/dtype.h"
#include "worker/dataplane/communicator.h"

namespace shard {

// dst[i] = a[i] op b[i] for i < count; dst may alias a or b. 16-bit floats are reduced in
// float and rounded back (to nearest even), as NCCL does. Vectorised: element by element, so
// the results are those of scalar code.
void ReduceBuffers(DataType dtype, ReduceOp op, void* dst, const void* a, const void* b,
                   size_t count);

// data[i] /= divisor for i < count: averaging gradients before they are summed, as DDP does.
// Vectorised; every element rounds as the scalar division would.
void DivideBuffer(float* data, size_t count, float divisor);

// A contiguous run of elements: one rank's block of a collective.
struct Block {
  size_t offset = 0;
  size_t count = 0;
};

// `count` elements in `ranks` blocks whose sizes differ by at most one element (the first ones
// larger): how an all-reduce splits its buffer.
std::vector<Block> BalancedBlocks(int ranks, size_t count);

}  // namespace shard
