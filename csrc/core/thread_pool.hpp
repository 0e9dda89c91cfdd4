// A small fixed pool for host-side parallel work (memcpy shards, first-touch of new slabs). The caller
// runs shard 0 itself, so a one-core machine pays no thread hop.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace gpu_offload {

class ThreadPool {
 public:
  static ThreadPool& instance();
  // Threads the pool has (or will have) from GPU_OFFLOAD_NUM_THREADS and the cores; throws on a bad value.
  static std::size_t configured_threads();
  std::size_t num_threads() const { return workers_.size() + 1; }
  // Runs fn(i) for i in [0, n) spread over the pool and the caller; returns when all are done and
  // rethrows the first exception any shard raised.
  void parallel_for(std::size_t n, const std::function<void(std::size_t)>& fn);
  ~ThreadPool();

 private:
  explicit ThreadPool(std::size_t num_workers);
  void worker_loop();

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::mutex job_mutex_;  // one parallel_for at a time; concurrent callers queue here
  std::condition_variable wake_, finished_;
  const std::function<void(std::size_t)>* job_ = nullptr;
  std::size_t job_size_ = 0, next_ = 0, pending_ = 0, generation_ = 0;
  std::exception_ptr error_;
  bool stop_ = false;
  int owner_pid_;  // a forked child has none of the workers: it runs jobs on the calling thread
};

}  // namespace gpu_offload
