// A minimal test harness for the torch-free core: CHECK records a failure with its line and goes on;
// main returns non-zero if anything failed, which is what ctest reads.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

namespace check {
// A fresh folder /tmp/<prefix>XXXXXX, removed with everything in it when this process exits (the tests'
// forked children leave through _exit, which runs no atexit handler: only the process that made it removes it).
inline std::string scratch_dir(const char* prefix) {
  static std::vector<std::string> dirs;
  static const bool registered = (std::atexit([] {
                                    std::error_code ec;
                                    for (const std::string& d : dirs) std::filesystem::remove_all(d, ec);
                                  }),
                                  true);
  (void)registered;
  std::string path = std::string("/tmp/") + prefix + "XXXXXX";
  if (mkdtemp(path.data()) == nullptr) throw std::runtime_error("mkdtemp " + path + " failed");
  dirs.push_back(path);
  return path;
}

inline int& failures() {
  static int n = 0;
  return n;
}
inline std::vector<std::pair<std::string, std::function<void()>>>& registry() {
  static std::vector<std::pair<std::string, std::function<void()>>> r;
  return r;
}
struct Register {
  Register(const char* name, std::function<void()> fn) { registry().emplace_back(name, std::move(fn)); }
};
// Runs every case, or only those named on the command line (ctest runs each sim_* case on its own).
inline int run_all(int argc = 0, char** argv = nullptr) {
  std::vector<std::string> only(argv != nullptr ? argv + 1 : argv, argv != nullptr ? argv + argc : argv);
  for (const std::string& name : only) {
    bool known = false;
    for (auto& entry : registry()) known = known || entry.first == name;
    if (!known) {
      std::printf("no test case named %s\n", name.c_str());
      return 1;
    }
  }
  for (auto& [name, fn] : registry()) {
    bool selected = only.empty();
    for (const std::string& o : only) selected = selected || o == name;
    if (!selected) continue;
    const int before = failures();
    try {
      fn();
    } catch (const std::exception& e) {
      std::printf("  %s: unexpected exception: %s\n", name.c_str(), e.what());
      ++failures();
    }
    std::printf("%s %s\n", failures() == before ? "PASS" : "FAIL", name.c_str());
  }
  return failures() == 0 ? 0 : 1;
}
}  // namespace check

#define TEST_CASE(name)                                          \
  static void name();                                            \
  static check::Register register_##name(#name, name);           \
  static void name()

#define CHECK(cond)                                                              \
  do {                                                                           \
    if (!(cond)) {                                                               \
      std::printf("  %s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond);     \
      ++check::failures();                                                       \
    }                                                                            \
  } while (0)

#define CHECK_THROWS(stmt)                                                       \
  do {                                                                           \
    bool thrown_ = false;                                                        \
    try {                                                                        \
      stmt;                                                                      \
    } catch (const std::exception&) {                                            \
      thrown_ = true;                                                            \
    }                                                                            \
    if (!thrown_) {                                                              \
      std::printf("  %s:%d: %s did not throw\n", __FILE__, __LINE__, #stmt);     \
      ++check::failures();                                                       \
    }                                                                            \
  } while (0)
