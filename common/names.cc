#include "common/names.h"

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace shard {

absl::Status ValidateName(absl::string_view what, absl::string_view value) {
  constexpr size_t kMaxLength = 128;
  if (value.empty()) return absl::InvalidArgumentError(absl::StrCat(what, " must not be empty"));
  if (value.size() > kMaxLength) {
    return absl::InvalidArgumentError(absl::StrCat(what, " is ", value.size(),
                                                   " characters long; the limit is ", kMaxLength));
  }
  if (value == "." || value == "..") {
    return absl::InvalidArgumentError(absl::StrCat(what, " must not be '", value, "'"));
  }
  for (size_t i = 0; i < value.size(); ++i) {
    const char c = value[i];
    if (absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-') {
      continue;
    }
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s '%s' has character '%s' at position %d; only letters, digits, '.', '_' and '-' are "
        "allowed",
        what, absl::CHexEscape(value), absl::CHexEscape(absl::string_view(&value[i], 1)), i));
  }
  return absl::OkStatus();
}

}  // namespace shard
