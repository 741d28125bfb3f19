// The record of a checkpoint or snapshot shard (common/checkpoint.h ShardRecord: its size, the
// XXH3-64 of the whole and of every kCheckpointBlockBytes block) computed as its bytes arrive, in
// pieces of any size: the writer of a shard file, a snapshot taken in memory and a replica
// received from a peer all describe their bytes alike.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/checkpoint.h"

namespace shard {

class ShardHasher {
 public:
  enum class Sums {
    kWholeAndBlocks,
    // The blocks' alone, half the work: what checks bytes against a record whose blocks cover
    // every byte (the record's whole-shard hash then adds nothing). Finish leaves xxh3 empty.
    kBlocksOnly,
  };
  explicit ShardHasher(Sums sums = Sums::kWholeAndBlocks);
  ~ShardHasher();
  ShardHasher(const ShardHasher&) = delete;
  ShardHasher& operator=(const ShardHasher&) = delete;

  void Append(const void* data, size_t bytes);
  uint64_t bytes() const { return bytes_; }
  // The record of everything appended, named `file` and `rank`.
  ShardRecord Finish(std::string file, int rank);

 private:
  void* whole_;  // XXH3 state of everything; null with Sums::kBlocksOnly
  void* block_;  // XXH3 state of the current block
  uint64_t bytes_ = 0;
  std::vector<std::string> blocks_;
};

// The record of `bytes` bytes at `data`, at once.
ShardRecord HashShard(const char* data, uint64_t bytes, std::string file, int rank);

}  // namespace shard
