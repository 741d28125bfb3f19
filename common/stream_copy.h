// Copies that bypass the processor's caches, for bytes that are kept rather than computed with
// next (a snapshot, a checkpoint's bytes read into the engine).
#pragma once

#include <cstddef>

namespace shard {

// Copies `bytes` from `from` to `to` with streaming (non-temporal) stores, linearly; the copy is
// complete and visible to other threads on return. Any alignment of either side.
void StreamCopy(char* to, const char* from, size_t bytes);

}  // namespace shard
