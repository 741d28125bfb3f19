#include "common/shard_hasher.h"

#include <algorithm>

#include "absl/strings/str_format.h"
#include "common/xxh3.h"

namespace shard {
namespace {

XXH3_state_t* State(void* state) { return static_cast<XXH3_state_t*>(state); }

}  // namespace

ShardHasher::ShardHasher(Sums sums)
    : whole_(sums == Sums::kWholeAndBlocks ? XXH3_createState() : nullptr),
      block_(XXH3_createState()) {
  if (whole_ != nullptr) XXH3_64bits_reset(State(whole_));
  XXH3_64bits_reset(State(block_));
}

ShardHasher::~ShardHasher() {
  if (whole_ != nullptr) XXH3_freeState(State(whole_));
  XXH3_freeState(State(block_));
}

void ShardHasher::Append(const void* data, size_t bytes) {
  // Both hashes read a piece small enough to stay in the cache between them, so the bytes come
  // from memory once.
  constexpr uint64_t kPiece = 64 << 10;
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const uint64_t room = kCheckpointBlockBytes - bytes_ % kCheckpointBlockBytes;
    const size_t take = static_cast<size_t>(std::min<uint64_t>({room, bytes, kPiece}));
    if (whole_ != nullptr) XXH3_64bits_update(State(whole_), p, take);
    XXH3_64bits_update(State(block_), p, take);
    bytes_ += take;
    p += take;
    bytes -= take;
    if (bytes_ % kCheckpointBlockBytes == 0) {
      blocks_.push_back(absl::StrFormat("%016x", XXH3_64bits_digest(State(block_))));
      XXH3_64bits_reset(State(block_));
    }
  }
}

ShardRecord ShardHasher::Finish(std::string file, int rank) {
  if (bytes_ % kCheckpointBlockBytes != 0) {
    blocks_.push_back(absl::StrFormat("%016x", XXH3_64bits_digest(State(block_))));
    XXH3_64bits_reset(State(block_));
  }
  return ShardRecord{
      std::move(file), rank, bytes_,
      whole_ != nullptr ? absl::StrFormat("%016x", XXH3_64bits_digest(State(whole_))) : "",
      blocks_, {}};
}

ShardRecord HashShard(const char* data, uint64_t bytes, std::string file, int rank) {
  ShardHasher hasher;
  hasher.Append(data, bytes);
  return hasher.Finish(std::move(file), rank);
}

}  // namespace shard
