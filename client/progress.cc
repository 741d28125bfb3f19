#include "client/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"

namespace shard {

ProgressBar::ProgressBar(std::string label, uint64_t total, std::string unit)
    : label_(std::move(label)),
      total_(total),
      unit_(std::move(unit)),
      terminal_(::isatty(STDOUT_FILENO) != 0),
      started_(absl::Now()),
      last_draw_(absl::InfinitePast()) {}

std::string ProgressBar::Amount(uint64_t value) const {
  if (unit_ != "bytes") return absl::StrCat(value, " ", unit_);
  if (value >= (uint64_t{1} << 30)) return absl::StrFormat("%.2f GiB", value / 1073741824.0);
  if (value >= (uint64_t{1} << 20)) return absl::StrFormat("%.1f MiB", value / 1048576.0);
  return absl::StrFormat("%.1f KiB", value / 1024.0);
}

void ProgressBar::Update(uint64_t done) {
  done = std::min(done, total_);
  const double fraction = total_ == 0 ? 1.0 : static_cast<double>(done) / total_;
  const absl::Time now = absl::Now();
  if (terminal_) {
    if (now - last_draw_ < absl::Milliseconds(100) && done < total_) return;
    last_draw_ = now;
    constexpr int kWidth = 30;
    const int filled = static_cast<int>(fraction * kWidth);
    std::printf("\r%s [%s%s] %3.0f%% %s / %s", label_.c_str(), std::string(filled, '#').c_str(),
                std::string(kWidth - filled, '.').c_str(), 100 * fraction, Amount(done).c_str(),
                Amount(total_).c_str());
    std::fflush(stdout);
    return;
  }
  const int quarter = static_cast<int>(fraction * 4);
  if (quarter == last_quarter_) return;
  last_quarter_ = quarter;
  std::printf("%s: %3.0f%% (%s of %s)\n", label_.c_str(), 100 * fraction, Amount(done).c_str(),
              Amount(total_).c_str());
  std::fflush(stdout);
}

void ProgressBar::Finish() {
  if (finished_) return;
  finished_ = true;
  Update(total_);
  const double seconds = absl::ToDoubleSeconds(absl::Now() - started_);
  if (terminal_) std::printf("\n");
  if (unit_ == "bytes" && seconds > 0) {
    std::printf("%s: done in %.2f s (%.2f GB/s)\n", label_.c_str(), seconds,
                total_ / seconds / 1e9);
  } else {
    std::printf("%s: done in %.2f s\n", label_.c_str(), seconds);
  }
  std::fflush(stdout);
}

}  // namespace shard
