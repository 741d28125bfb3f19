#include "common/journal.h"

#include <cstring>

#include "common/xxh3.h"

namespace shard {
namespace {

uint64_t Checksum(JournalFrameKind kind, absl::string_view payload) {
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  const uint8_t kind_byte = static_cast<uint8_t>(kind);
  XXH3_64bits_update(state, &kind_byte, 1);
  XXH3_64bits_update(state, payload.data(), payload.size());
  const uint64_t sum = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return sum;
}

void PutLittleEndian(uint64_t value, int bytes, std::string* out) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

uint64_t GetLittleEndian(const char* in, int bytes) {
  uint64_t value = 0;
  for (int i = 0; i < bytes; ++i) value |= uint64_t{static_cast<uint8_t>(in[i])} << (8 * i);
  return value;
}

}  // namespace

std::string EncodeJournalFrame(JournalFrameKind kind, absl::string_view payload) {
  std::string frame;
  frame.reserve(kJournalFrameHeaderBytes + payload.size());
  PutLittleEndian(payload.size(), 4, &frame);
  frame.push_back(static_cast<char>(kind));
  PutLittleEndian(Checksum(kind, payload), 8, &frame);
  frame.append(payload.data(), payload.size());
  return frame;
}

JournalContents DecodeJournal(absl::string_view file) {
  JournalContents contents;
  size_t at = 0;
  while (file.size() - at >= kJournalFrameHeaderBytes) {
    const char* header = file.data() + at;
    const uint64_t length = GetLittleEndian(header, 4);
    const uint8_t kind = static_cast<uint8_t>(header[4]);
    const uint64_t sum = GetLittleEndian(header + 5, 8);
    if (kind != static_cast<uint8_t>(JournalFrameKind::kSnapshot) &&
        kind != static_cast<uint8_t>(JournalFrameKind::kDelta)) {
      break;
    }
    if (file.size() - at - kJournalFrameHeaderBytes < length) break;
    const absl::string_view payload = file.substr(at + kJournalFrameHeaderBytes, length);
    if (Checksum(static_cast<JournalFrameKind>(kind), payload) != sum) break;
    contents.frames.push_back(JournalFrame{static_cast<JournalFrameKind>(kind), std::string(payload)});
    at += kJournalFrameHeaderBytes + length;
  }
  contents.intact_bytes = at;
  return contents;
}

}  // namespace shard
