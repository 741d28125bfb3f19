// The framing of an append-only journal file (the coordinator's membership journal): a
// snapshot frame, then delta frames appended after it. Each frame carries its length, kind and
// an XXH3 checksum, so a reader keeps every whole frame and stops at a torn tail: an append a
// crash cut short was never acknowledged (acknowledgements wait for fsync), so dropping it
// loses nothing anyone was told.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace shard {

enum class JournalFrameKind : uint8_t { kSnapshot = 1, kDelta = 2 };

struct JournalFrame {
  JournalFrameKind kind = JournalFrameKind::kDelta;
  std::string payload;
};

// Header bytes before each payload: length (4), kind (1), checksum (8).
inline constexpr size_t kJournalFrameHeaderBytes = 13;

std::string EncodeJournalFrame(JournalFrameKind kind, absl::string_view payload);

struct JournalContents {
  std::vector<JournalFrame> frames;  // every whole, intact frame, in order
  size_t intact_bytes = 0;           // where they end; anything after is a torn tail
};

// Reads frames from the start of `file` until the end or the first frame that is cut short,
// of an unknown kind or fails its checksum.
JournalContents DecodeJournal(absl::string_view file);

}  // namespace shard
