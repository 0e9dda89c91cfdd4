#include "ledger.hpp"

#include <fcntl.h>
#include <pthread.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "errors.hpp"

namespace gpu_offload {

namespace {

// The file: a 64-byte header (magic), then one 32-byte slot per process that ever reserved.
constexpr char kMagic[8] = {'G', 'O', 'L', 'E', 'D', 'G', '0', '1'};
constexpr off_t kHeaderBytes = 64;
constexpr off_t kSlotBytes = 32;
constexpr std::size_t kNamedUsers = 3;  // the largest other users an error names

off_t slot_offset(std::size_t index) { return kHeaderBytes + static_cast<off_t>(index) * kSlotBytes; }

// The sum of what the slots hold, saturating: a crafted or corrupt file cannot wrap it below the budget.
std::size_t add_saturating(std::size_t a, std::uint64_t b) {
  return b > SIZE_MAX - a ? SIZE_MAX : a + static_cast<std::size_t>(b);
}

std::string human(std::size_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%zu bytes (%.2f GiB)", bytes, bytes / double(1u << 30));
  return buf;
}

// A process's start time in clock ticks since boot (field 22 of /proc/<pid>/stat); 0 when unknown.
std::uint64_t start_ticks(std::int64_t pid) {
  std::ifstream file("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  const auto paren = text.rfind(')');  // the command name may hold spaces and parentheses
  if (paren == std::string::npos) return 0;
  std::istringstream rest(text.substr(paren + 1));
  std::string field;
  for (int i = 3; i <= 22 && (rest >> field); ++i) {
    if (i == 22) return std::strtoull(field.c_str(), nullptr, 10);
  }
  return 0;
}

// One-byte open-file-description lock at `offset`: held by the file description, so by the process that
// opened it, until that process closes it or dies; another close of the file in the same process (a
// POSIX lock's pitfall) does not drop it.
int ofd_lock(int fd, int cmd, short type, off_t offset) {
  struct flock fl;
  std::memset(&fl, 0, sizeof(fl));
  fl.l_type = type;
  fl.l_whence = SEEK_SET;
  fl.l_start = offset;
  fl.l_len = 1;
  int rc;
  do {
    rc = fcntl(fd, cmd, &fl);
  } while (rc != 0 && errno == EINTR);
  if (rc == 0 && cmd == F_OFD_GETLK) return fl.l_type == F_UNLCK ? 0 : 1;
  return rc;
}

}  // namespace

NodeLedger& NodeLedger::instance() {
  static NodeLedger* ledger = [] {
    auto* l = new NodeLedger();
    pthread_atfork(&NodeLedger::atfork_prepare, &NodeLedger::atfork_parent, &NodeLedger::atfork_child);
    return l;
  }();
  return *ledger;
}

// A forked child is a process of its own: it must not write into its parent's slot (it shares the parent's
// open file, and so its locks). The mutex is held across fork() so that the child never inherits it locked.
void NodeLedger::atfork_prepare() { instance().mutex_.lock(); }
void NodeLedger::atfork_parent() { instance().mutex_.unlock(); }
void NodeLedger::atfork_child() {
  NodeLedger& l = instance();
  l.after_fork_in_child();
  l.mutex_.unlock();
}

void NodeLedger::after_fork_in_child() noexcept {
  if (fd_ >= 0) close(fd_);  // the parent's locks stay: they belong to the file description, still open there
  fd_ = -1;
  slot_ = -1;
  own_bytes_ = 0;
}

void NodeLedger::configure(const std::string& dir, std::size_t max_bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  const std::string path = dir + "/gpu_offload-ledger-uid" + std::to_string(getuid());
  if (path != path_) {
    GO_CHECK(own_bytes_ == 0, "cannot move the node ledger to " + dir + " while this process holds " +
                                  human(own_bytes_) + " in " + path_);
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
    slot_ = -1;
  }
  dir_ = dir;
  path_ = path;
  max_bytes_ = max_bytes;
}

bool NodeLedger::enabled() const { return max_bytes_ != 0; }

bool NodeLedger::open_file(bool create) {
  if (fd_ >= 0) return true;
  if (path_.empty()) return false;
  const int fd = open(path_.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW | (create ? O_CREAT : 0), 0600);
  if (fd < 0) {
    if (!create && errno == ENOENT) return false;
    GO_FAIL("cannot open the node ledger " + path_ + ": " + std::strerror(errno) +
            " (GPU_OFFLOAD_LEDGER_DIR must name a folder that every process of the node can write)");
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    GO_FAIL("the node ledger " + path_ + " is not a regular file");
  }
  if (st.st_uid != getuid()) {
    // /dev/shm is writable by everyone: a file of this name that another user made could steer this
    // process's budget (or read its figures). Refused rather than trusted.
    close(fd);
    GO_FAIL("the node ledger " + path_ + " belongs to uid " + std::to_string(st.st_uid) + ", not to this " +
            "process's uid " + std::to_string(getuid()) + "; remove it, or point GPU_OFFLOAD_LEDGER_DIR at a " +
            "folder of your own");
  }
  fd_ = fd;
  return true;
}

void NodeLedger::lock_file() {
  if (locks_work_ && ofd_lock(fd_, F_OFD_SETLKW, F_WRLCK, 0) == 0) return;
  if (locks_work_ && errno != EINVAL) {
    GO_FAIL("cannot lock the node ledger " + path_ + ": " + std::strerror(errno));
  }
  // No open-file-description locks here (an old kernel or an unusual file system): a whole-file lock,
  // and liveness by PID and start time.
  locks_work_ = false;
  int rc;
  do {
    rc = flock(fd_, LOCK_EX);
  } while (rc != 0 && errno == EINTR);
  GO_CHECK(rc == 0, "cannot lock the node ledger " + path_ + ": " + std::strerror(errno));
}

void NodeLedger::unlock_file() noexcept {
  if (locks_work_) {
    ofd_lock(fd_, F_OFD_SETLK, F_UNLCK, 0);
  } else {
    flock(fd_, LOCK_UN);
  }
}

std::vector<NodeLedger::Slot> NodeLedger::read_slots() {
  struct stat st;
  GO_CHECK(fstat(fd_, &st) == 0, "cannot read the node ledger " + path_ + ": " + std::strerror(errno));
  if (st.st_size < kHeaderBytes) {  // new: write the header (under the file lock)
    char header[kHeaderBytes] = {};
    std::memcpy(header, kMagic, sizeof(kMagic));
    GO_CHECK(pwrite(fd_, header, sizeof(header), 0) == static_cast<ssize_t>(sizeof(header)),
             "cannot write the node ledger " + path_ + ": " + std::strerror(errno));
    return {};
  }
  std::vector<char> data(static_cast<std::size_t>(st.st_size));
  GO_CHECK(pread(fd_, data.data(), data.size(), 0) == static_cast<ssize_t>(data.size()),
           "cannot read the node ledger " + path_ + ": " + std::strerror(errno));
  GO_CHECK(std::memcmp(data.data(), kMagic, sizeof(kMagic)) == 0,
           "the node ledger " + path_ + " is not a gpu_offload ledger (remove it, or point GPU_OFFLOAD_LEDGER_DIR "
           "elsewhere)");
  std::vector<Slot> slots((data.size() - kHeaderBytes) / kSlotBytes);
  for (std::size_t i = 0; i < slots.size(); ++i) std::memcpy(&slots[i], data.data() + slot_offset(i), sizeof(Slot));
  return slots;
}

void NodeLedger::write_slot(std::size_t index, const Slot& slot) {
  GO_CHECK(pwrite(fd_, &slot, sizeof(slot), slot_offset(index)) == static_cast<ssize_t>(sizeof(slot)),
           "cannot write the node ledger " + path_ + ": " + std::strerror(errno));
}

bool NodeLedger::slot_alive(std::size_t index, const Slot& slot) {
  if (static_cast<long>(index) == slot_) return true;
  if (locks_work_) {
    const int held = ofd_lock(fd_, F_OFD_GETLK, F_WRLCK, slot_offset(index));
    if (held >= 0) return held == 1;
  }
  return slot.pid > 0 && slot.start_ticks != 0 && start_ticks(slot.pid) == slot.start_ticks;
}

void NodeLedger::reclaim_dead(std::vector<Slot>* slots) {
  for (std::size_t i = 0; i < slots->size(); ++i) {
    Slot& s = (*slots)[i];
    if (s.bytes != 0 && !slot_alive(i, s)) {
      s = Slot{0, 0, 0, 0};
      write_slot(i, s);
    }
  }
}

void NodeLedger::claim_slot(std::vector<Slot>* slots) {
  std::size_t index = slots->size();
  for (std::size_t i = 0; i < slots->size(); ++i) {
    if ((*slots)[i].bytes == 0 && !slot_alive(i, (*slots)[i])) {
      index = i;
      break;
    }
  }
  if (locks_work_) {
    GO_CHECK(ofd_lock(fd_, F_OFD_SETLK, F_WRLCK, slot_offset(index)) == 0,
             "cannot take a slot in the node ledger " + path_ + ": " + std::strerror(errno));
  }
  const Slot mine{static_cast<std::int64_t>(getpid()), start_ticks(getpid()), 0, max_bytes_};
  if (index == slots->size()) slots->push_back(mine);
  (*slots)[index] = mine;
  write_slot(index, mine);
  slot_ = static_cast<long>(index);
}

void NodeLedger::reserve(std::size_t num_bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (max_bytes_ == 0 || num_bytes == 0) return;
  open_file(true);
  lock_file();
  try {
    std::vector<Slot> slots = read_slots();
    reclaim_dead(&slots);
    std::size_t total = 0;
    for (const Slot& s : slots) total = add_saturating(total, s.bytes);
    if (num_bytes > max_bytes_ || total > max_bytes_ - num_bytes) {
      std::vector<LedgerUser> others;
      for (std::size_t i = 0; i < slots.size(); ++i) {
        if (slots[i].bytes != 0 && static_cast<long>(i) != slot_) others.push_back({slots[i].pid, slots[i].bytes});
      }
      std::sort(others.begin(), others.end(), [](const LedgerUser& a, const LedgerUser& b) { return a.bytes > b.bytes; });
      std::string users;
      std::size_t rest = 0;
      for (std::size_t i = 0; i < others.size(); ++i) {
        if (i < kNamedUsers) {
          users += (users.empty() ? "" : ", ") + std::string("pid ") + std::to_string(others[i].pid) + " holds " +
                   human(others[i].bytes);
        } else {
          rest = add_saturating(rest, others[i].bytes);
        }
      }
      if (others.size() > kNamedUsers) {
        users += " and " + std::to_string(others.size() - kNamedUsers) + " more hold " + human(rest);
      }
      // A refusal the user acts on, not a broken invariant: the message alone, without a check's text.
      throw Error("node host-memory budget exceeded: pinning " + human(num_bytes) +
                  " more would bring the node's processes to " + human(add_saturating(total, num_bytes)) +
                  ", over the budget of " + human(max_bytes_) + " (GPU_OFFLOAD_NODE_MAX_BYTES, ledger " + path_ +
                  "); this process (pid " + std::to_string(getpid()) + ") holds " + human(own_bytes_) +
                  "; the largest other users: " + (users.empty() ? std::string("none") : users) +
                  ". Free snapshots and offloads there and give the slabs back (Arena.trim()), or raise "
                  "GPU_OFFLOAD_NODE_MAX_BYTES");
    }
    if (slot_ < 0) claim_slot(&slots);
    own_bytes_ += num_bytes;
    Slot& mine = slots[static_cast<std::size_t>(slot_)];
    mine.bytes = own_bytes_;
    mine.max_bytes = max_bytes_;
    write_slot(static_cast<std::size_t>(slot_), mine);
  } catch (...) {
    unlock_file();
    throw;
  }
  unlock_file();
}

void NodeLedger::release(std::size_t num_bytes) noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  if (fd_ < 0 || slot_ < 0 || num_bytes == 0) return;
  own_bytes_ -= std::min(num_bytes, own_bytes_);
  try {
    lock_file();
    const Slot mine{static_cast<std::int64_t>(getpid()), start_ticks(getpid()), own_bytes_, max_bytes_};
    try {
      write_slot(static_cast<std::size_t>(slot_), mine);
    } catch (...) {
    }
    unlock_file();
  } catch (...) {
    // Cannot happen short of a broken file system; the share is taken back when this process exits.
  }
}

LedgerState NodeLedger::state() {
  std::lock_guard<std::mutex> lock(mutex_);
  LedgerState out;
  out.max_bytes = max_bytes_;
  out.path = path_;
  out.own_bytes = own_bytes_;
  if (!open_file(false)) return out;
  lock_file();
  try {
    std::vector<Slot> slots = read_slots();
    reclaim_dead(&slots);
    for (const Slot& s : slots) {
      if (s.bytes == 0) continue;
      out.reserved_bytes = add_saturating(out.reserved_bytes, s.bytes);
      out.users.push_back({s.pid, s.bytes});
    }
  } catch (...) {
    unlock_file();
    throw;
  }
  unlock_file();
  std::sort(out.users.begin(), out.users.end(), [](const LedgerUser& a, const LedgerUser& b) { return a.bytes > b.bytes; });
  return out;
}

}  // namespace gpu_offload
