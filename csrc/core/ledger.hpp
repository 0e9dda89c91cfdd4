// NodeLedger: one host-memory budget for every process of a node, kept in a small file in shared memory.
// No server: each process reserves a slab's bytes in the file, under a lock on the file, before pinning it,
// and gives them back when the slab is released. Each process owns one slot of the file and holds a lock on
// it for as long as it lives; the kernel drops that lock when the process dies, however it dies (SIGKILL
// included), so a slot nobody holds is a dead process's share, taken back at the next reservation by anyone.
// Unlike a PID (reused, and meaningless across PID namespaces: containers that share a ledger folder), the
// lock cannot name the wrong process.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace gpu_offload {

struct LedgerUser {
  std::int64_t pid = 0;  // as this process's PID namespace sees it (the writer's own number otherwise)
  std::size_t bytes = 0;
};

struct LedgerState {
  std::size_t max_bytes = 0;       // this process's budget; 0: none
  std::size_t reserved_bytes = 0;  // by every live process of the node
  std::size_t own_bytes = 0;       // by this process
  std::string path;                // the ledger file ("" when none is configured)
  std::vector<LedgerUser> users;   // live processes with bytes reserved, largest first
};

class NodeLedger {
 public:
  // The process's ledger (never destroyed: arenas may release slabs during exit).
  static NodeLedger& instance();

  // max_bytes 0 turns the budget off: nothing is reserved or recorded then. The file is
  // <dir>/gpu_offload-ledger-uid<uid> (one per user: the ranks of a job run as one user).
  void configure(const std::string& dir, std::size_t max_bytes);
  bool enabled() const;

  // Reserves num_bytes for this process; throws Error (naming the budget, this process's share and the
  // largest other users) when the node's live reservations would exceed the budget. No-op when disabled.
  void reserve(std::size_t num_bytes);
  // Gives back up to num_bytes of this process's share. Never throws.
  void release(std::size_t num_bytes) noexcept;
  // The live reservations (dead processes' shares are taken back first); empty when no ledger file exists.
  LedgerState state();

  NodeLedger(const NodeLedger&) = delete;
  NodeLedger& operator=(const NodeLedger&) = delete;

 private:
  NodeLedger() = default;
  struct Slot {
    std::int64_t pid;
    std::uint64_t start_ticks;  // the owner's start time (/proc/<pid>/stat), for the PID check fallback
    std::uint64_t bytes;
    std::uint64_t max_bytes;  // the owner's budget, for the record
  };
  bool open_file(bool create);
  void lock_file();
  void unlock_file() noexcept;
  std::vector<Slot> read_slots();
  void write_slot(std::size_t index, const Slot& slot);
  bool slot_alive(std::size_t index, const Slot& slot);
  void reclaim_dead(std::vector<Slot>* slots);
  void claim_slot(std::vector<Slot>* slots);
  void after_fork_in_child() noexcept;
  static void atfork_prepare();
  static void atfork_parent();
  static void atfork_child();

  std::mutex mutex_;
  std::string dir_;
  std::string path_;
  std::size_t max_bytes_ = 0;
  int fd_ = -1;
  bool locks_work_ = true;   // OFD locks on this file system; otherwise PID + start time decide liveness
  long slot_ = -1;           // this process's slot, once it reserved something
  std::size_t own_bytes_ = 0;
};

}  // namespace gpu_offload
