#include "errors.hpp"

#include <cstring>

namespace gpu_offload {

[[noreturn]] void throw_error(const char* file, int line, const char* expr, const std::string& message) {
  const char* base = std::strrchr(file, '/');
  std::string where = std::string(base ? base + 1 : file) + ":" + std::to_string(line);
  std::string text = message;
  text += expr ? " (check `" + std::string(expr) + "` failed at " + where + ")" : " (at " + where + ")";
  throw Error(text);
}

}  // namespace gpu_offload
