// Errors carry the file, the line and the failed expression, and for CUDA the error's name and string,
// so a report from a user's cluster says where it broke without a rebuild. Never exit(): the Python layer
// turns every Error into gpu_offload.OffloadError.
#pragma once

#include <stdexcept>
#include <string>

namespace gpu_offload {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

[[noreturn]] void throw_error(const char* file, int line, const char* expr, const std::string& message);

}  // namespace gpu_offload

#define GO_CHECK(cond, message)                                                  \
  do {                                                                           \
    if (!(cond)) ::gpu_offload::throw_error(__FILE__, __LINE__, #cond, (message)); \
  } while (0)

#define GO_FAIL(message) ::gpu_offload::throw_error(__FILE__, __LINE__, nullptr, (message))
