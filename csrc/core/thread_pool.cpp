#include "thread_pool.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "errors.hpp"

namespace gpu_offload {

std::size_t ThreadPool::configured_threads() {
  // GPU_OFFLOAD_NUM_THREADS sets the host threads; default: the cores. Either way at most 16 (memcpy
  // saturates memory bandwidth well before that). Anything but a positive integer is refused, not read as 1.
  std::size_t n = std::max(1u, std::thread::hardware_concurrency());
  if (const char* env = std::getenv("GPU_OFFLOAD_NUM_THREADS"); env != nullptr && *env != '\0') {
    const std::string value(env);
    const bool digits = value.size() <= 9 && value.find_first_not_of("0123456789") == std::string::npos;
    if (!digits || std::stoul(value) < 1) {
      GO_FAIL("GPU_OFFLOAD_NUM_THREADS='" + value + "' is not a positive integer (the host copy threads, at most 16)");
    }
    n = std::stoul(value);
  }
  return std::min<std::size_t>(n, 16);
}

ThreadPool& ThreadPool::instance() {
  // Never destroyed: joining workers from a static destructor at process exit races whatever else is
  // shutting down (other libraries' threads, an interpreter tearing down); the OS reclaims them.
  // A refused GPU_OFFLOAD_NUM_THREADS throws here, before the pool exists; the next call tries again.
  static ThreadPool* pool = new ThreadPool(configured_threads() - 1);
  return *pool;
}

ThreadPool::ThreadPool(std::size_t num_workers) : owner_pid_(static_cast<int>(getpid())) {
  for (std::size_t i = 0; i < num_workers; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  if (static_cast<int>(getpid()) != owner_pid_) {
    // A forked child: the workers exist only in the parent. Joining or detaching them here would fail,
    // and destroying a joinable std::thread terminates, so their handles are deliberately leaked.
    for (auto& t : workers_) new std::thread(std::move(t));
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::worker_loop() {
  std::size_t seen = 0;
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    while (job_ != nullptr && next_ < job_size_) {
      std::size_t i = next_++;
      const auto* job = job_;
      lock.unlock();
      try {
        (*job)(i);
      } catch (...) {
        std::lock_guard<std::mutex> g(mutex_);
        if (!error_) error_ = std::current_exception();
      }
      lock.lock();
      if (--pending_ == 0) finished_.notify_all();
    }
  }
}

void ThreadPool::parallel_for(std::size_t n, const std::function<void(std::size_t)>& fn) {
  if (n == 0) return;
  if (n == 1 || workers_.empty() || static_cast<int>(getpid()) != owner_pid_) {
    for (std::size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::lock_guard<std::mutex> serial(job_mutex_);
  std::unique_lock<std::mutex> lock(mutex_);
  job_ = &fn;
  job_size_ = n;
  next_ = 0;
  pending_ = n;
  error_ = nullptr;
  ++generation_;
  wake_.notify_all();
  // The caller works too.
  while (next_ < job_size_) {
    std::size_t i = next_++;
    lock.unlock();
    try {
      fn(i);
    } catch (...) {
      std::lock_guard<std::mutex> g(mutex_);
      if (!error_) error_ = std::current_exception();
    }
    lock.lock();
    --pending_;
  }
  finished_.wait(lock, [&] { return pending_ == 0; });
  job_ = nullptr;
  std::exception_ptr error = error_;
  error_ = nullptr;
  lock.unlock();
  if (error) std::rethrow_exception(error);
}

}  // namespace gpu_offload
