#include "common/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/files.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace shard {
namespace {

// Headers larger than this are refused as hostile (the format's own readers use 100 MB).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

absl::Status Corrupt(const std::string& path, absl::string_view what) {
  return absl::DataLossError(absl::StrCat("'", path, "' is not a valid safetensors file: ", what));
}

uint64_t ReadLittleEndian64(const unsigned char* bytes) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | bytes[i];
  return value;
}

}  // namespace

absl::string_view SafetensorsDtypeName(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32: return "F32";
    case DataType::kFloat16: return "F16";
    case DataType::kBFloat16: return "BF16";
    case DataType::kInt64: return "I64";
    case DataType::kFloat64: return "F64";
  }
  return "?";
}

absl::StatusOr<DataType> ParseSafetensorsDtype(absl::string_view name) {
  for (DataType dtype : {DataType::kFloat32, DataType::kFloat16, DataType::kBFloat16,
                         DataType::kInt64, DataType::kFloat64}) {
    if (name == SafetensorsDtypeName(dtype)) return dtype;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "dtype '", name, "' is not supported; Shard reads F32, F16, BF16, I64 and F64"));
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::StatusOr<std::unique_ptr<SafetensorsReader>> SafetensorsReader::Open(
    const std::string& path) {
  std::unique_ptr<SafetensorsReader> reader(new SafetensorsReader());
  reader->path_ = path;
  reader->fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (reader->fd_ < 0) {
    const std::string message = absl::StrCat("cannot open '", path, "': ", std::strerror(errno));
    return errno == ENOENT ? absl::NotFoundError(message) : absl::InternalError(message);
  }
  struct stat info;
  if (::fstat(reader->fd_, &info) != 0) {
    return absl::InternalError(absl::StrCat("cannot stat '", path, "': ", std::strerror(errno)));
  }
  const uint64_t file_size = static_cast<uint64_t>(info.st_size);
  if (file_size < 8) return Corrupt(path, absl::StrCat("it is only ", file_size, " bytes long"));
  unsigned char length_bytes[8];
  SHARD_RETURN_IF_ERROR(ReadAt(reader->fd_, 0, length_bytes, 8, path));
  const uint64_t header_bytes = ReadLittleEndian64(length_bytes);
  if (header_bytes > kMaxHeaderBytes || header_bytes > file_size - 8) {
    return Corrupt(path, absl::StrCat("its header length ", header_bytes,
                                      " exceeds the file (", file_size, " bytes) or 100 MB"));
  }
  std::string header(header_bytes, '\0');
  SHARD_RETURN_IF_ERROR(ReadAt(reader->fd_, 8, header.data(), header_bytes, path));
  reader->data_start_ = 8 + header_bytes;
  const uint64_t data_bytes = file_size - reader->data_start_;

  const nlohmann::json doc = nlohmann::json::parse(header, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object()) {
    return Corrupt(path, "its header is not a JSON object");
  }
  for (const auto& [name, entry] : doc.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) return Corrupt(path, "__metadata__ is not an object");
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string()) {
          return Corrupt(path, absl::StrCat("__metadata__ value of '", key, "' is not a string"));
        }
        reader->metadata_[key] = value.get<std::string>();
      }
      continue;
    }
    const std::string where = absl::StrCat("tensor '", name, "'");
    // Shard's writer refuses empty names, and no parameter has one.
    if (name.empty()) return Corrupt(path, "a tensor has an empty name");
    if (!entry.is_object() || !entry.contains("dtype") || !entry.contains("shape") ||
        !entry.contains("data_offsets") || !entry["dtype"].is_string() ||
        !entry["shape"].is_array() || !entry["data_offsets"].is_array() ||
        entry["data_offsets"].size() != 2) {
      return Corrupt(path, absl::StrCat(where, " needs dtype, shape and two data_offsets"));
    }
    TensorInfo tensor;
    tensor.name = name;
    absl::StatusOr<DataType> dtype = ParseSafetensorsDtype(entry["dtype"].get<std::string>());
    if (!dtype.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", path, "': ", where, ": ", dtype.status().message()));
    }
    tensor.dtype = *dtype;
    uint64_t numel = 1;
    for (const nlohmann::json& dim : entry["shape"]) {
      if (!dim.is_number_unsigned()) {
        return Corrupt(path, absl::StrCat(where, " has a negative or non-integer dimension"));
      }
      const uint64_t d = dim.get<uint64_t>();
      // After a zero dimension the product no longer bounds the others; a size beyond int64
      // would become a negative dimension.
      if (d > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return Corrupt(path, absl::StrCat(where, " has a dimension beyond 2^63"));
      }
      if (d != 0 && numel > data_bytes / d) {
        return Corrupt(path, absl::StrCat(where, " is larger than the file"));
      }
      numel *= d;
      tensor.shape.push_back(static_cast<int64_t>(d));
    }
    for (const nlohmann::json& offset : entry["data_offsets"]) {
      if (!offset.is_number_unsigned()) {
        return Corrupt(path, absl::StrCat(where, " has a negative or non-integer data offset"));
      }
    }
    tensor.begin = entry["data_offsets"][0].get<uint64_t>();
    tensor.end = entry["data_offsets"][1].get<uint64_t>();
    if (tensor.begin > tensor.end || tensor.end > data_bytes) {
      return Corrupt(path, absl::StrCat(where, " has data_offsets [", tensor.begin, ", ",
                                        tensor.end, "] outside the ", data_bytes,
                                        " data bytes (truncated file?)"));
    }
    if (tensor.end - tensor.begin != numel * DataTypeSize(tensor.dtype)) {
      return Corrupt(path, absl::StrCat(where, " has ", tensor.end - tensor.begin,
                                        " bytes but its dtype and shape need ",
                                        numel * DataTypeSize(tensor.dtype)));
    }
    reader->tensors_.push_back(std::move(tensor));
  }
  std::sort(reader->tensors_.begin(), reader->tensors_.end(),
            [](const TensorInfo& a, const TensorInfo& b) {
              return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
            });
  // The data section must be covered exactly: no overlaps, no holes, nothing after the end.
  uint64_t expected = 0;
  for (const TensorInfo& tensor : reader->tensors_) {
    if (tensor.begin != expected) {
      return Corrupt(path, absl::StrCat("tensor '", tensor.name, "' starts at byte ", tensor.begin,
                                        " where byte ", expected,
                                        tensor.begin < expected ? " is already used (overlap)"
                                                                : " was expected (hole)"));
    }
    expected = tensor.end;
  }
  if (expected != data_bytes) {
    return Corrupt(path, absl::StrCat("its tensors cover ", expected, " of its ", data_bytes,
                                      " data bytes"));
  }
  return reader;
}

SafetensorsReader::~SafetensorsReader() {
  if (fd_ >= 0) ::close(fd_);
}

const TensorInfo* SafetensorsReader::Find(absl::string_view name) const {
  for (const TensorInfo& tensor : tensors_) {
    if (tensor.name == name) return &tensor;
  }
  return nullptr;
}

absl::StatusOr<const TensorInfo*> SafetensorsReader::Expect(
    absl::string_view name, DataType dtype, const std::vector<int64_t>& shape) const {
  const TensorInfo* tensor = Find(name);
  if (tensor == nullptr) {
    return absl::NotFoundError(absl::StrCat("'", path_, "' has no tensor '", name, "'"));
  }
  if (tensor->dtype != dtype || tensor->shape != shape) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", path_, "': tensor '", name, "' is ", SafetensorsDtypeName(tensor->dtype), "[",
        absl::StrJoin(tensor->shape, ", "), "] but ", SafetensorsDtypeName(dtype), "[",
        absl::StrJoin(shape, ", "), "] is needed"));
  }
  return tensor;
}

absl::Status SafetensorsReader::ReadElements(const TensorInfo& tensor, int64_t element_offset,
                                             int64_t count, void* out) const {
  if (element_offset < 0 || count < 0 || element_offset + count > tensor.numel()) {
    return absl::OutOfRangeError(absl::StrCat("elements [", element_offset, ", ",
                                              element_offset + count, ") are outside tensor '",
                                              tensor.name, "' of ", tensor.numel(), " in '", path_,
                                              "'"));
  }
  const uint64_t esize = DataTypeSize(tensor.dtype);
  return ReadAt(fd_, data_start_ + tensor.begin + static_cast<uint64_t>(element_offset) * esize,
                out, static_cast<size_t>(count) * esize, path_);
}

absl::StatusOr<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::Create(
    const std::string& path, std::vector<TensorDecl> tensors,
    const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const TensorDecl& tensor : tensors) {
    if (tensor.name.empty() || tensor.name == "__metadata__" || header.contains(tensor.name)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor name '", tensor.name, "' is empty, reserved or repeated"));
    }
    uint64_t numel = 1;
    for (int64_t d : tensor.shape) {
      if (d < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor '", tensor.name, "' has a negative dimension"));
      }
      numel *= static_cast<uint64_t>(d);
    }
    const uint64_t bytes = numel * DataTypeSize(tensor.dtype);
    header[tensor.name] = {{"dtype", std::string(SafetensorsDtypeName(tensor.dtype))},
                           {"shape", tensor.shape},
                           {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  // Pad with spaces so the data section starts 8-byte aligned, as the reference writer does.
  text.append((8 - text.size() % 8) % 8, ' ');
  unsigned char length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<unsigned char>((text.size() >> (8 * i)) & 0xff);

  std::unique_ptr<SafetensorsWriter> writer(new SafetensorsWriter());
  SHARD_ASSIGN_OR_RETURN(std::unique_ptr<AtomicFileWriter> file, AtomicFileWriter::Create(path));
  writer->file_ = std::move(file);
  writer->path_ = path;
  writer->expected_bytes_ = offset;
  SHARD_RETURN_IF_ERROR(
      writer->file_->Write(absl::string_view(reinterpret_cast<const char*>(length), 8)));
  SHARD_RETURN_IF_ERROR(writer->file_->Write(text));
  return writer;
}

SafetensorsWriter::~SafetensorsWriter() = default;

absl::Status SafetensorsWriter::Append(const void* data, size_t bytes) {
  if (written_bytes_ + bytes > expected_bytes_) {
    return absl::InvalidArgumentError(absl::StrCat("'", path_, "': ", written_bytes_ + bytes,
                                                   " bytes appended but the declared tensors "
                                                   "hold ",
                                                   expected_bytes_));
  }
  written_bytes_ += bytes;
  return file_->Write(absl::string_view(static_cast<const char*>(data), bytes));
}

absl::Status SafetensorsWriter::Finish() {
  if (written_bytes_ != expected_bytes_) {
    return absl::FailedPreconditionError(absl::StrCat("'", path_, "': only ", written_bytes_,
                                                      " of ", expected_bytes_,
                                                      " tensor bytes were written"));
  }
  return file_->Commit();
}

absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorDecl>& tensors,
                              const std::vector<const void*>& data,
                              const std::map<std::string, std::string>& metadata) {
  if (tensors.size() != data.size()) {
    return absl::InvalidArgumentError("WriteSafetensors needs one data pointer per tensor");
  }
  SHARD_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsWriter> writer,
                         SafetensorsWriter::Create(path, tensors, metadata));
  for (size_t i = 0; i < tensors.size(); ++i) {
    int64_t numel = 1;
    for (int64_t d : tensors[i].shape) numel *= d;
    SHARD_RETURN_IF_ERROR(writer->Append(data[i], numel * DataTypeSize(tensors[i].dtype)));
  }
  return writer->Finish();
}

}  // namespace shard
