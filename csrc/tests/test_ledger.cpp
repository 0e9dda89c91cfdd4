// The node ledger across real processes: fork() stands for the ranks of a node.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "check.hpp"
#include "core/arena.hpp"
#include "core/errors.hpp"
#include "core/ledger.hpp"

using gpu_offload::HostArena;
using gpu_offload::NodeLedger;
using gpu_offload::PinMode;

constexpr std::size_t kMiB = 1u << 20;

namespace {

std::string temp_dir() { return check::scratch_dir("go_ledger_"); }

// Runs fn in a child process; returns its pid. The child exits with fn's result (never returns here).
template <typename Fn>
pid_t spawn(Fn fn) {
  std::fflush(stdout);  // or the child prints what the parent had buffered
  const pid_t pid = fork();
  if (pid == 0) {
    int code = 99;
    try {
      code = fn();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child %d: %s\n", getpid(), e.what());
    }
    _exit(code);
  }
  return pid;
}

int exit_code(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// A pipe a child writes one byte into once it is ready; the parent waits for it.
struct Ready {
  int fds[2];
  Ready() { CHECK(pipe(fds) == 0); }
  void signal() const {
    char c = 1;
    (void)!write(fds[1], &c, 1);
  }
  void wait() const {
    char c;
    (void)!read(fds[0], &c, 1);
  }
};

}  // namespace

TEST_CASE(a_slab_is_pinned_only_under_the_budget_and_the_error_names_the_users) {
  NodeLedger& ledger = NodeLedger::instance();
  ledger.configure(temp_dir(), 8 * kMiB);
  Ready ready, done;
  const pid_t other = spawn([&] {
    HostArena arena(0, kMiB, PinMode::kNone);
    arena.allocate(3 * kMiB);
    ready.signal();
    done.wait();  // holds its share until told
    return 0;
  });
  ready.wait();
  CHECK(ledger.state().reserved_bytes == 3 * kMiB);
  auto owned = std::make_unique<HostArena>(0, kMiB, PinMode::kNone);
  HostArena& arena = *owned;
  arena.allocate(4 * kMiB);
  const auto before = arena.stats();
  std::string what;
  try {
    arena.allocate(2 * kMiB);
  } catch (const gpu_offload::Error& e) {
    what = e.what();
  }
  CHECK(what.find("node host-memory budget exceeded") != std::string::npos);
  CHECK(what.find("budget of 8388608 bytes") != std::string::npos);
  CHECK(what.find("this process (pid " + std::to_string(getpid()) + ") holds 4194304 bytes") != std::string::npos);
  CHECK(what.find("pid " + std::to_string(other) + " holds 3145728 bytes") != std::string::npos);
  CHECK(arena.stats().capacity_bytes == before.capacity_bytes);  // nothing pinned for the refused request
  auto state = ledger.state();
  CHECK(state.reserved_bytes == 7 * kMiB && state.own_bytes == 4 * kMiB && state.users.size() == 2);
  CHECK(state.users[0].pid == getpid() && state.users[0].bytes == 4 * kMiB);
  done.signal();
  CHECK(exit_code(other) == 0);
  arena.allocate(2 * kMiB);  // the child's exit gave its share back
  CHECK(ledger.state().reserved_bytes == 6 * kMiB);
  CHECK_THROWS(ledger.configure(temp_dir(), 0));  // not while this process holds reservations there
  owned.reset();  // an arena that goes gives its slabs' share back
  CHECK(ledger.state().reserved_bytes == 0);
  ledger.configure(temp_dir(), 0);
}

TEST_CASE(a_sigkilled_process_share_is_back_at_the_next_reservation) {
  NodeLedger& ledger = NodeLedger::instance();
  const std::string dir = temp_dir();
  ledger.configure(dir, 4 * kMiB);
  Ready ready;
  const pid_t victim = spawn([&] {
    HostArena arena(0, kMiB, PinMode::kNone);
    arena.allocate(3 * kMiB);
    ready.signal();
    pause();
    return 0;
  });
  ready.wait();
  HostArena arena(0, kMiB, PinMode::kNone);
  CHECK_THROWS(arena.allocate(2 * kMiB));
  kill(victim, SIGKILL);
  CHECK(exit_code(victim) == 128 + SIGKILL);
  auto p = arena.allocate(2 * kMiB);  // the dead process's 3 MiB were taken back by this reservation
  auto state = ledger.state();
  CHECK(state.reserved_bytes == 2 * kMiB && state.users.size() == 1 && state.users[0].pid == getpid());
  arena.free(p);
  CHECK(arena.trim() == 2 * kMiB);
  CHECK(ledger.state().reserved_bytes == 0);  // trim gives the share back
  ledger.configure(dir, 0);
}

TEST_CASE(a_forked_child_has_a_share_of_its_own) {
  NodeLedger& ledger = NodeLedger::instance();
  const std::string dir = temp_dir();
  ledger.configure(dir, 16 * kMiB);
  ledger.reserve(kMiB);
  const pid_t child = spawn([&] {
    // Not the parent's slot: reserving here must not change what the parent holds.
    NodeLedger::instance().reserve(2 * kMiB);
    auto s = NodeLedger::instance().state();
    return s.own_bytes == 2 * kMiB && s.reserved_bytes == 3 * kMiB ? 0 : 1;
  });
  CHECK(exit_code(child) == 0);
  auto state = ledger.state();  // the child died holding 2 MiB: taken back; the parent's 1 MiB stays
  CHECK(state.reserved_bytes == kMiB && state.own_bytes == kMiB && state.users.size() == 1);
  ledger.release(kMiB);
  CHECK(ledger.state().reserved_bytes == 0);
  ledger.configure(dir, 0);
}

TEST_CASE(eight_processes_of_random_reserves_and_releases_never_exceed_the_budget) {
  NodeLedger& ledger = NodeLedger::instance();
  const std::string dir = temp_dir();
  const std::size_t budget = 10 * kMiB;
  ledger.configure(dir, budget);
  std::vector<pid_t> children;
  for (int c = 0; c < 8; ++c) {
    children.push_back(spawn([&, c] {
      std::mt19937 rng(1234 + c);
      NodeLedger& l = NodeLedger::instance();
      std::vector<std::size_t> held;
      int refused = 0;
      for (int step = 0; step < 200; ++step) {
        if (held.empty() || rng() % 2 == 0) {
          const std::size_t n = (1 + rng() % 16) * 64 * 1024;
          try {
            l.reserve(n);
            held.push_back(n);
          } catch (const gpu_offload::Error&) {
            ++refused;
          }
        } else {
          const std::size_t i = rng() % held.size();
          l.release(held[i]);
          held.erase(held.begin() + static_cast<long>(i));
        }
        if (l.state().reserved_bytes > budget) return 1;  // a consistent read, under the file's lock
      }
      if (c % 2 == 0) {  // half give everything back, half exit holding their share
        for (std::size_t n : held) l.release(n);
      }
      std::printf("  child %d: %d of 200 steps refused\n", c, refused);
      std::fflush(stdout);
      return 0;
    }));
  }
  for (pid_t pid : children) CHECK(exit_code(pid) == 0);
  auto state = ledger.state();
  CHECK(state.reserved_bytes == 0 && state.users.empty());
  ledger.configure(dir, 0);
}

TEST_CASE(a_crafted_ledger_cannot_wrap_the_total_or_come_from_another_user) {
  NodeLedger& ledger = NodeLedger::instance();
  const std::string dir = temp_dir();
  const std::string path = dir + "/gpu_offload-ledger-uid" + std::to_string(getuid());
  // Two live slots of 2^63 bytes each: a plain sum wraps to 0 and would let anything through.
  {
    char header[64] = {'G', 'O', 'L', 'E', 'D', 'G', '0', '1'};
    std::uint64_t slots[2][4] = {{1, 0, 1ull << 63, 0}, {1, 0, 1ull << 63, 0}};
    FILE* f = std::fopen(path.c_str(), "wb");
    CHECK(f != nullptr);
    std::fwrite(header, 1, sizeof(header), f);
    std::fwrite(slots, 1, sizeof(slots), f);
    std::fclose(f);
  }
  Ready ready, done;
  const pid_t holder = spawn([&] {  // keeps both slots alive, as their owners would
    const int fd = open(path.c_str(), O_RDWR);
    for (off_t offset : {off_t(64), off_t(96)}) {
      struct flock fl = {};
      fl.l_type = F_WRLCK;
      fl.l_whence = SEEK_SET;
      fl.l_start = offset;
      fl.l_len = 1;
      if (fd < 0 || fcntl(fd, F_OFD_SETLK, &fl) != 0) return 1;
    }
    ready.signal();
    done.wait();
    return 0;
  });
  ready.wait();
  ledger.configure(dir, 8 * kMiB);
  std::string what;
  try {
    ledger.reserve(kMiB);
  } catch (const gpu_offload::Error& e) {
    what = e.what();
  }
  CHECK(what.find("node host-memory budget exceeded") != std::string::npos);
  CHECK(ledger.state().reserved_bytes == SIZE_MAX);  // saturated, not wrapped
  done.signal();
  CHECK(exit_code(holder) == 0);
  ledger.reserve(kMiB);  // the holder is gone: both slots are taken back
  CHECK(ledger.state().reserved_bytes == kMiB);
  ledger.release(kMiB);
  ledger.configure(dir, 0);
  // A ledger file of another user's (in a folder everyone may write, such as /dev/shm) is refused.
  if (getuid() == 0) {
    const std::string other_dir = temp_dir();
    const std::string other = other_dir + "/gpu_offload-ledger-uid0";
    std::fclose(std::fopen(other.c_str(), "wb"));
    CHECK(chown(other.c_str(), 12345, 12345) == 0);
    ledger.configure(other_dir, 8 * kMiB);
    what.clear();
    try {
      ledger.reserve(kMiB);
    } catch (const gpu_offload::Error& e) {
      what = e.what();
    }
    CHECK(what.find("belongs to uid 12345") != std::string::npos);
    ledger.configure(other_dir, 0);
  } else {
    std::printf("  (not root: the other-user case is not run)\n");
  }
}

TEST_CASE(without_a_budget_nothing_is_recorded) {
  NodeLedger& ledger = NodeLedger::instance();
  const std::string dir = temp_dir();
  ledger.configure(dir, 0);
  HostArena arena(0, kMiB, PinMode::kNone);
  arena.allocate(2 * kMiB);
  auto state = ledger.state();
  CHECK(state.reserved_bytes == 0 && state.own_bytes == 0);
  CHECK(access((dir + "/gpu_offload-ledger-uid" + std::to_string(getuid())).c_str(), F_OK) != 0);  // no file
}

int main() { return check::run_all(); }
