// Fuzz target: the safetensors reader (common/safetensors.h, SafetensorsReader::Open), which
// reads data files, initial weights and exported checkpoints that come from outside.
// Promise: DataLoss / InvalidArgument, or a reader whose tensors have non-negative dimensions,
// byte ranges that lie inside the data section, match dtype x shape, don't overlap and cover
// it exactly; every tensor can be read in full. Writing the tensors and metadata again with
// WriteSafetensors and reading that file gives the same tensors, bytes and metadata.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/safetensors.h"
#include "tests/fuzz/fuzz_check.h"

namespace {

using shard::SafetensorsReader;
using shard::TensorInfo;

// The input as a file: one memory-backed file, rewritten for every input.
const std::string& InputPath() {
  static const std::string path = [] {
    const int fd = memfd_create("safetensors-fuzz-input", 0);
    FUZZ_CHECK(fd >= 0, "memfd_create failed");
    return absl::StrCat("/proc/self/fd/", fd);
  }();
  return path;
}

// Where the round-trip copy is written (a temporary directory, removed at exit).
const std::string& OutputPath() {
  static const std::string path = [] {
    const char* base = std::filesystem::is_directory("/dev/shm") ? "/dev/shm" : "/tmp";
    std::string dir = absl::StrCat(base, "/shard-fuzz-XXXXXX");
    FUZZ_CHECK(mkdtemp(dir.data()) != nullptr, "mkdtemp failed");
    static const std::string to_remove = dir;
    std::atexit([] { std::filesystem::remove_all(to_remove); });
    return dir + "/copy.safetensors";
  }();
  return path;
}

void WriteInput(const uint8_t* data, size_t size) {
  const int fd = std::atoi(InputPath().c_str() + std::strlen("/proc/self/fd/"));
  FUZZ_CHECK(ftruncate(fd, 0) == 0, "ftruncate failed");
  size_t done = 0;
  while (done < size) {
    const ssize_t n = pwrite(fd, data + done, size - done, static_cast<off_t>(done));
    FUZZ_CHECK(n > 0, "pwrite failed");
    done += static_cast<size_t>(n);
  }
}

std::vector<char> ReadAll(const SafetensorsReader& reader, const TensorInfo& tensor) {
  std::vector<char> bytes(tensor.end - tensor.begin);
  const absl::Status read = reader.ReadElements(tensor, 0, tensor.numel(), bytes.data());
  FUZZ_CHECK(read.ok(), "tensor '%s' cannot be read: %s", tensor.name.c_str(),
             read.ToString().c_str());
  return bytes;
}

void CheckInvariants(const SafetensorsReader& reader, const uint8_t* file, size_t file_size) {
  FUZZ_CHECK(file_size >= 8, "accepted a %zu-byte file", file_size);
  uint64_t header = 0;
  for (int i = 7; i >= 0; --i) header = (header << 8) | file[i];
  FUZZ_CHECK(header <= file_size - 8, "accepted a header longer than the file");
  const uint64_t data_bytes = file_size - 8 - header;
  uint64_t covered = 0;
  for (const TensorInfo& tensor : reader.tensors()) {
    FUZZ_CHECK(tensor.name != "__metadata__", "a tensor named __metadata__");
    FUZZ_CHECK(reader.Find(tensor.name) == &tensor, "Find('%s') finds another tensor",
               tensor.name.c_str());
    unsigned __int128 numel = 1;
    for (int64_t d : tensor.shape) {
      FUZZ_CHECK(d >= 0, "tensor '%s' has dimension %lld", tensor.name.c_str(),
                 static_cast<long long>(d));
      numel *= static_cast<uint64_t>(d);
      if (numel > file_size) numel = static_cast<unsigned __int128>(file_size) + 1;
    }
    FUZZ_CHECK(tensor.begin <= tensor.end && tensor.end <= data_bytes,
               "range outside the data section");
    FUZZ_CHECK(numel * shard::DataTypeSize(tensor.dtype) == tensor.end - tensor.begin,
               "tensor '%s': %llu bytes for its dtype and shape", tensor.name.c_str(),
               static_cast<unsigned long long>(tensor.end - tensor.begin));
    FUZZ_CHECK(static_cast<int64_t>(numel) == tensor.numel(), "numel() disagrees");
    // tensors() is sorted by offset, so "no overlap and no hole" is "each starts where the
    // previous ended".
    FUZZ_CHECK(tensor.begin == covered, "tensor '%s' at %llu, expected %llu",
               tensor.name.c_str(), static_cast<unsigned long long>(tensor.begin),
               static_cast<unsigned long long>(covered));
    covered = tensor.end;
  }
  FUZZ_CHECK(covered == data_bytes, "tensors cover %llu of %llu data bytes",
             static_cast<unsigned long long>(covered), static_cast<unsigned long long>(data_bytes));
}

void CheckRoundTrip(const SafetensorsReader& reader) {
  std::vector<shard::TensorDecl> decls;
  std::vector<std::vector<char>> bytes;
  for (const TensorInfo& tensor : reader.tensors()) {
    decls.push_back(shard::TensorDecl{tensor.name, tensor.dtype, tensor.shape});
    bytes.push_back(ReadAll(reader, tensor));
  }
  std::vector<const void*> pointers;
  for (const std::vector<char>& b : bytes) pointers.push_back(b.data());
  const absl::Status written =
      shard::WriteSafetensors(OutputPath(), decls, pointers, reader.metadata());
  FUZZ_CHECK(written.ok(), "cannot write what was read: %s", written.ToString().c_str());
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> copy = SafetensorsReader::Open(OutputPath());
  FUZZ_CHECK(copy.ok(), "cannot read what was written: %s", copy.status().ToString().c_str());
  FUZZ_CHECK((*copy)->metadata() == reader.metadata(), "metadata changed");
  FUZZ_CHECK((*copy)->tensors().size() == reader.tensors().size(), "tensor count changed");
  for (size_t i = 0; i < decls.size(); ++i) {
    const TensorInfo* tensor = (*copy)->Find(decls[i].name);
    FUZZ_CHECK(tensor != nullptr, "tensor '%s' lost", decls[i].name.c_str());
    FUZZ_CHECK(tensor->dtype == decls[i].dtype && tensor->shape == decls[i].shape,
               "tensor '%s' changed its dtype or shape", decls[i].name.c_str());
    FUZZ_CHECK(ReadAll(**copy, *tensor) == bytes[i], "tensor '%s' changed its bytes",
               decls[i].name.c_str());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  WriteInput(data, size);
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader = SafetensorsReader::Open(InputPath());
  if (!reader.ok()) {
    FUZZ_CHECK(absl::IsDataLoss(reader.status()) || absl::IsInvalidArgument(reader.status()),
               "unexpected error code: %s", reader.status().ToString().c_str());
    return 0;
  }
  CheckInvariants(**reader, data, size);
  CheckRoundTrip(**reader);
  return 0;
}
