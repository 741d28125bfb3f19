// safetensors, the format of Hugging Face and PyTorch tools: an 8-byte little-endian header
// length, a JSON header {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]},
// "__metadata__": {"key": "value"}}, then the raw little-endian tensor bytes. Files are untrusted
// input: sizes, offsets, overlaps and holes are checked before any byte is used. Reads are
// positioned (pread) so a process reads only the ranges it needs; writes stream tensor by tensor
// and commit atomically.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"
#include "common/files.h"

namespace shard {

// safetensors dtype names: F32, F16, BF16, I64, F64.
absl::string_view SafetensorsDtypeName(DataType dtype);
absl::StatusOr<DataType> ParseSafetensorsDtype(absl::string_view name);

struct TensorInfo {
  std::string name;
  DataType dtype = DataType::kFloat32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets in the data section
  uint64_t end = 0;

  int64_t numel() const;
};

class SafetensorsReader {
 public:
  // Opens and validates `path`; errors name the file and what is wrong with it.
  static absl::StatusOr<std::unique_ptr<SafetensorsReader>> Open(const std::string& path);
  ~SafetensorsReader();
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }  // by offset
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Null if there is no such tensor.
  const TensorInfo* Find(absl::string_view name) const;
  // The tensor `name`, checked to have `dtype` and `shape`; errors say what was found instead.
  absl::StatusOr<const TensorInfo*> Expect(absl::string_view name, DataType dtype,
                                           const std::vector<int64_t>& shape) const;

  // Copies elements [element_offset, element_offset + count) of `tensor` into `out`.
  absl::Status ReadElements(const TensorInfo& tensor, int64_t element_offset, int64_t count,
                            void* out) const;

 private:
  SafetensorsReader() = default;

  std::string path_;
  int fd_ = -1;
  uint64_t data_start_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

struct TensorDecl {
  std::string name;
  DataType dtype = DataType::kFloat32;
  std::vector<int64_t> shape;
};

// Writes a file whose tensors are all declared up front (the header comes first) and whose
// bytes then arrive in declaration order, in pieces of any size, so that the writer never
// holds more than the caller's piece. The file appears under its name only after Finish():
// written to a temporary name, fsynced, renamed, directory fsynced.
class SafetensorsWriter {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsWriter>> Create(
      const std::string& path, std::vector<TensorDecl> tensors,
      const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();  // removes the temporary file if Finish() was not reached
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // The next `bytes` of the data section (tensors in declaration order).
  absl::Status Append(const void* data, size_t bytes);
  absl::Status Finish();

 private:
  SafetensorsWriter() = default;

  std::string path_;
  std::unique_ptr<AtomicFileWriter> file_;
  uint64_t expected_bytes_ = 0;
  uint64_t written_bytes_ = 0;
};

// Writes whole in-memory tensors (`data[i]` holds tensors[i]'s bytes).
absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorDecl>& tensors,
                              const std::vector<const void*>& data,
                              const std::map<std::string, std::string>& metadata = {});

}  // namespace shard
