// A progress bar for long shardctl operations: redrawn in place on a terminal, a line per
// quarter otherwise (so logs and pipes stay readable).
#pragma once

#include <cstdint>
#include <string>

#include "absl/time/time.h"

namespace shard {

class ProgressBar {
 public:
  // `unit`: "bytes" prints sizes; anything else prints counts followed by the unit.
  ProgressBar(std::string label, uint64_t total, std::string unit = "bytes");
  void Update(uint64_t done);
  void Finish();

 private:
  std::string Amount(uint64_t value) const;

  std::string label_;
  uint64_t total_;
  std::string unit_;
  bool terminal_;
  int last_quarter_ = -1;
  absl::Time started_;
  absl::Time last_draw_;
  bool finished_ = false;
};

}  // namespace shard
