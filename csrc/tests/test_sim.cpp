// The GPU path on the simulated driver (sim_driver.hpp): copy_batch and CopyPlan, the fork and join of the
// kernel and copy-engine streams, chunk-table reuse, error paths and their waits, several devices,
// contexts, capture, checksums, kernel loading. ctest runs each case in its own process (a fresh simulator).
// Delays and gates make a missing wait show up as wrong bytes or as a call that returns too early; a gate is
// released by the test, so a correct engine never depends on a clock (only the broken one is caught by one).
#include <dirent.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "check.hpp"
#include "core/arena.hpp"
#include "core/checksum.hpp"
#include "core/copy_plan.hpp"
#include "core/cuda_backend.hpp"
#include "core/cuda_engine.hpp"
#include "core/driver_api.hpp"
#include "core/errors.hpp"
#include "core/sim_driver.hpp"

using namespace gpu_offload;

namespace {

bool g_skip = false;

void start(sim::Config c = {}) {
  if (!sim::enable(c)) {
    std::printf("  the simulator could not be enabled\n");
    std::exit(1);
  }
}

unsigned char pattern(std::size_t i, unsigned seed) { return static_cast<unsigned char>((i * 131 + seed * 7 + (i >> 9)) & 0xff); }

// Device storages of the given sizes, filled with a pattern, and their plan into one region.
struct Storages {
  int device;
  std::vector<std::uintptr_t> ptrs;
  std::vector<std::size_t> sizes, offsets;
  std::size_t extent = 0;
  Storages(int dev, const std::vector<std::size_t>& s, unsigned seed) : device(dev), sizes(s) {
    for (std::size_t n : sizes) {
      ptrs.push_back(sim::mem_alloc(device, n));
      offsets.push_back(extent);
      extent += (n + 255) / 256 * 256;
    }
    fill(seed);
  }
  void fill(unsigned seed) {
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      auto* p = reinterpret_cast<unsigned char*>(ptrs[k]);
      for (std::size_t i = 0; i < sizes[k]; ++i) p[i] = pattern(i + k, seed);
    }
  }
  void clear() {
    for (std::size_t k = 0; k < sizes.size(); ++k) std::memset(reinterpret_cast<void*>(ptrs[k]), 0, sizes[k]);
  }
  bool device_is(unsigned seed) const {
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      const auto* p = reinterpret_cast<const unsigned char*>(ptrs[k]);
      for (std::size_t i = 0; i < sizes[k]; ++i) {
        if (p[i] != pattern(i + k, seed)) return false;
      }
    }
    return true;
  }
  bool host_is(std::uintptr_t region, unsigned seed, std::size_t first = 0, std::size_t last = ~std::size_t(0)) const {
    for (std::size_t k = first; k < sizes.size() && k < last; ++k) {
      const auto* p = reinterpret_cast<const unsigned char*>(region + offsets[k]);
      for (std::size_t i = 0; i < sizes[k]; ++i) {
        if (p[i] != pattern(i + k, seed)) return false;
      }
    }
    return true;
  }
  CopyPlan plan(std::size_t gather_max) const { return CopyPlan(device, ptrs, offsets, sizes, gather_max); }
  // A batch of this layout into `region`: copies up to gather_max bytes in the kernel list.
  cuda::Batch batch(bool to_host, std::uintptr_t region, std::size_t gather_max) const {
    cuda::Batch b;
    b.to_host = to_host;
    b.host_base = region;
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      auto* host = reinterpret_cast<void*>(region + offsets[k]);
      auto* dev = reinterpret_cast<void*>(ptrs[k]);
      cuda::CopyList& list = sizes[k] <= gather_max ? b.kernel : b.engine;
      if (to_host) {
        list.push(host, dev, sizes[k]);
      } else {
        list.push(dev, host, sizes[k]);
      }
    }
    return b;
  }
};

const std::vector<std::size_t> kMixed = {1, 3, 4096, 70000, 200000, 1u << 20, 5, 65536, 3u << 20};
constexpr std::size_t kGather = 256 * 1024;

std::uintptr_t stream(int device, int which) { return cuda::engine_streams(device)[which]; }
constexpr int kCopyD2H = 0, kCopyH2D = 1, kKernelD2H = 2;

// Waits (up to a minute: the simulator's threads are never that slow) until `flag` is set.
bool eventually(const std::atomic<bool>& flag) {
  for (int i = 0; i < 60000 && !flag; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return flag;
}

void pause() { std::this_thread::sleep_for(std::chrono::milliseconds(200)); }

}  // namespace

TEST_CASE(sim_copy_batch_round_trip) {
  start();
  Storages s(0, kMixed, 1);
  HostArena arena(0, 8u << 20, PinMode::kRegister);
  const std::uintptr_t region = arena.allocate(s.extent);
  CHECK(sim::host_mapped(region, s.extent));
  CopyPlan plan = s.plan(kGather);
  CHECK(plan.num_kernel_copies() == 7);
  const std::uintptr_t user = sim::stream_create(0);
  plan.run(Direction::kToHost, region, user, {}, true)->synchronize();
  CHECK(s.host_is(region, 1));
  s.clear();
  plan.run(Direction::kToDevice, region, user, {}, true)->synchronize();
  CHECK(s.device_is(1));
  CHECK(sim::kernel_launches() == 2);             // one gather, one scatter
  CHECK(sim::calls("cuMemcpyBatchAsync") == 2);   // the engine part, batched (driver 13.0)
  CHECK(sim::sticky_error(0) == 0);
  arena.free(region);
}

TEST_CASE(sim_kernels_load_with_the_streams_never_inside_a_copy) {
  // A lazy load inside a copy can synchronize the context or wait behind a kernel that waits for a peer:
  // the module and both functions are loaded when the device's streams are made, and never again.
  sim::Config c;
  c.num_devices = 2;
  start(c);
  CHECK(sim::calls("cuModuleLoadData") == 0);
  cuda::engine_streams(0);
  CHECK(sim::calls("cuModuleLoadData") == 1);
  CHECK(sim::calls("cuModuleGetFunction") == 2 && sim::calls("cuFuncGetAttribute") == 2);
  Storages s(0, kMixed, 60);
  HostArena arena(0, 8u << 20, PinMode::kRegister);
  const std::uintptr_t region = arena.allocate(s.extent);
  const std::uintptr_t user = sim::stream_create(0);
  const std::size_t loads = sim::calls("cuModuleLoadData") + sim::calls("cuModuleGetFunction");
  s.plan(kGather).run(Direction::kToHost, region, user, {}, true)->synchronize();
  s.plan(kGather).run(Direction::kToDevice, region, user, {}, true)->synchronize();
  CHECK(cuda::checksum_device(0, s.ptrs, s.sizes, user) == checksum_host(s.ptrs, s.sizes));
  CHECK(sim::kernel_launches() == 3);
  CHECK(sim::calls("cuModuleLoadData") + sim::calls("cuModuleGetFunction") == loads);
  CHECK(!drv::primary_context_active(1));  // and nothing was loaded on a device the copies are not for
}

TEST_CASE(sim_per_copy_when_the_driver_lacks_batched_copies) {
  sim::Config c;
  c.driver_version = 12020;  // R535: no cuMemcpyBatchAsync
  c.batch = false;
  start(c);
  CHECK(!drv::driver_state().batched_copies);
  Storages s(0, kMixed, 2);
  HostArena arena(0, 8u << 20, PinMode::kRegister);
  const std::uintptr_t region = arena.allocate(s.extent);
  s.plan(0).run(Direction::kToHost, region, sim::stream_create(0), {}, true)->synchronize();
  CHECK(s.host_is(region, 2));
  CHECK(sim::calls("cuMemcpyBatchAsync") == 0);
  CHECK(sim::calls("cuMemcpyAsync") == kMixed.size());
}

TEST_CASE(sim_batched_copies_follow_the_driver_version_not_the_table) {
  sim::Config c;
  c.driver_version = 12060;  // the entry point is in the table, but the driver predates it
  start(c);
  CHECK(!drv::driver_state().batched_copies);
  Storages s(0, {100, 200, 300}, 3);
  HostArena arena(0, 4u << 20, PinMode::kRegister);
  const std::uintptr_t region = arena.allocate(s.extent);
  s.plan(0).run(Direction::kToHost, region, sim::stream_create(0), {}, true)->synchronize();
  CHECK(s.host_is(region, 3));
  CHECK(sim::calls("cuMemcpyBatchAsync") == 0);
}

TEST_CASE(sim_batched_copies_can_be_turned_off) {
  // GPU_OFFLOAD_BATCHED_COPIES=0: a 13.0 driver runs the per-copy path older drivers get.
  setenv("GPU_OFFLOAD_BATCHED_COPIES", "0", 1);
  start();
  CHECK(!drv::driver_state().batched_copies);
  Storages s(0, kMixed, 4);
  HostArena arena(0, 8u << 20, PinMode::kRegister);
  const std::uintptr_t region = arena.allocate(s.extent);
  s.plan(0).run(Direction::kToHost, region, sim::stream_create(0), {}, true)->synchronize();
  CHECK(s.host_is(region, 4));
  CHECK(sim::calls("cuMemcpyBatchAsync") == 0);
  CHECK(sim::calls("cuMemcpyAsync") == kMixed.size());
}

TEST_CASE(sim_fork_orders_kernel_and_engines_after_the_callers_stream) {
  // Work the caller enqueued before the snapshot (a fill, held back by a gate) must be in the snapshot:
  // both the copy engines and the kernel stream are ordered after it.
  start();
  Storages s(0, kMixed, 4);
  HostArena arena(0, 8u << 20, PinMode::kRegister);
  const std::uintptr_t region = arena.allocate(s.extent);
  const std::uintptr_t user = sim::stream_create(0);
  const auto gate = sim::gate(user);
  for (std::size_t k = 0; k < s.sizes.size(); ++k) {
    sim::enqueue_host(0, user, [&s, k] {
      auto* p = reinterpret_cast<unsigned char*>(s.ptrs[k]);
      for (std::size_t i = 0; i < s.sizes[k]; ++i) p[i] = pattern(i + k, 5);
    });
  }
  cuda::EventPtr done = s.plan(kGather).run(Direction::kToHost, region, user, {}, true);
  pause();  // time for a stream that wrongly does not wait to run ahead
  CHECK(!done->query());
  sim::release(gate);
  done->synchronize();
  CHECK(s.host_is(region, 5));
}

TEST_CASE(sim_join_makes_done_cover_the_kernel) {
  // The kernel stream is slow: `done` (recorded on the copy-engine stream) must still come after it.
  start();
  Storages s(0, kMixed, 6);
  HostArena arena(0, 8u << 20, PinMode::kRegister);
  const std::uintptr_t region = arena.allocate(s.extent);
  std::memset(reinterpret_cast<void*>(region), 0, s.extent);
  sim::set_delay(stream(0, kKernelD2H), 0.3);
  s.plan(kGather).run(Direction::kToHost, region, sim::stream_create(0), {}, true)->synchronize();
  CHECK(s.host_is(region, 6));
}

TEST_CASE(sim_copy_held_back_while_the_callers_stream_proceeds) {
  start();
  Storages s(0, {4096, 1u << 20}, 7);
  HostArena arena(0, 8u << 20, PinMode::kRegister);
  const std::uintptr_t region = arena.allocate(s.extent);
  const std::uintptr_t user = sim::stream_create(0);
  // stream_waits=false (overlap): the caller's stream runs on while the copy is held.
  const auto held = sim::gate(stream(0, kCopyD2H));
  cuda::EventPtr done = s.plan(0).run(Direction::kToHost, region, user, {}, false);
  std::atomic<bool> ran{false};
  sim::enqueue_host(0, user, [&] { ran = true; });
  CHECK(eventually(ran));
  CHECK(!done->query());
  sim::release(held);
  done->synchronize();
  CHECK(s.host_is(region, 7));

  // stream_waits=true: the caller's later work (a write into the source) waits for the held copy, so the
  // snapshot keeps the values as of the call.
  const auto held2 = sim::gate(stream(0, kCopyD2H));
  cuda::EventPtr done2 = s.plan(0).run(Direction::kToHost, region, user, {}, true);
  std::atomic<bool> wrote{false};
  sim::enqueue_host(0, user, [&] {
    s.fill(8);
    wrote = true;
  });
  pause();
  CHECK(!wrote);
  sim::release(held2);
  done2->synchronize();
  CHECK(eventually(wrote));
  CHECK(s.host_is(region, 7));
  CHECK(s.device_is(8));
}

TEST_CASE(sim_error_after_part_of_a_batch_waits_for_what_was_enqueued) {
  sim::Config c;
  c.batch = false;
  c.driver_version = 12020;
  start(c);
  Storages s(0, kMixed, 9);
  HostArena arena(0, 8u << 20, PinMode::kRegister);
  const std::uintptr_t region = arena.allocate(s.extent);
  std::memset(reinterpret_cast<void*>(region), 0, s.extent);
  const auto held = sim::gate(stream(0, kKernelD2H));
  // The kernel is launched first; then the second copy-engine copy fails.
  sim::fail("cuMemcpyAsync", 2, drv::kErrorOutOfMemory);
  const cuda::Batch batch = s.batch(true, region, kGather);
  std::atomic<bool> finished{false};
  std::string error;
  std::thread t([&] {
    try {
      cuda::copy_batch(0, batch, sim::stream_create(0), {}, true);
    } catch (const Error& e) {
      error = e.what();
    }
    finished = true;
  });
  pause();
  CHECK(!finished);  // it must not return (and let the caller free the region) while the kernel is pending
  sim::release(held);
  t.join();
  CHECK(error.find("CUDA_ERROR_OUT_OF_MEMORY") != std::string::npos);
  CHECK(error.find("cuMemcpyAsync") != std::string::npos);
  // The kernel's part had arrived by the time the error surfaced.
  for (std::size_t k = 0; k < s.sizes.size(); ++k) {
    if (s.sizes[k] <= kGather) CHECK(s.host_is(region, 9, k, k + 1));
  }
}

TEST_CASE(sim_refused_batched_copy_falls_back_to_single_copies) {
  start();
  Storages s(0, {100, 5000, 70000}, 10);
  HostArena arena(0, 4u << 20, PinMode::kRegister);
  const std::uintptr_t region = arena.allocate(s.extent);
  sim::fail("cuMemcpyBatchAsync", 1, drv::kErrorNotSupported);
  s.plan(0).run(Direction::kToHost, region, sim::stream_create(0), {}, true)->synchronize();
  CHECK(s.host_is(region, 10));
  CHECK(sim::calls("cuMemcpyAsync") == 3);
  const auto info = cuda::info();  // counted, so that a driver refusing every batch does not go unseen
  CHECK(info.num_batch_fallbacks == 1 && info.batch_error.find("CUDA_ERROR_NOT_SUPPORTED") != std::string::npos);
}

TEST_CASE(sim_chunk_table_is_not_reused_while_its_kernel_runs) {
  // Two batches back to back while the first one's kernel is slow: the second must not write its chunks
  // into the table the first kernel has yet to read (the first region would get the second's bytes).
  start();
  Storages a(0, {4096, 8192, 100}, 11);
  Storages b(0, {4096, 8192, 100}, 12);
  HostArena arena(0, 8u << 20, PinMode::kRegister);
  const std::uintptr_t ra = arena.allocate(a.extent), rb = arena.allocate(b.extent);
  sim::set_delay(stream(0, kKernelD2H), 0.3);
  const std::uintptr_t user = sim::stream_create(0);
  cuda::EventPtr ea = a.plan(kGather).run(Direction::kToHost, ra, user, {}, false);
  cuda::EventPtr eb = b.plan(kGather).run(Direction::kToHost, rb, user, {}, false);
  ea->synchronize();
  eb->synchronize();
  CHECK(a.host_is(ra, 11));
  CHECK(b.host_is(rb, 12));
}

TEST_CASE(sim_chunk_tables_are_reused_in_a_steady_loop) {
  start();
  Storages s(0, {4096, 8192}, 13);
  HostArena arena(0, 4u << 20, PinMode::kRegister);
  const std::uintptr_t region = arena.allocate(s.extent);
  const std::size_t before = sim::calls("cuMemHostAlloc");
  CopyPlan plan = s.plan(kGather);
  const std::uintptr_t user = sim::stream_create(0);
  for (int i = 0; i < 20; ++i) plan.run(Direction::kToHost, region, user, {}, true)->synchronize();
  CHECK(sim::calls("cuMemHostAlloc") - before == 1);
  CHECK(s.host_is(region, 13));
}

TEST_CASE(sim_chunk_table_pool_is_bounded_and_waits_for_the_oldest) {
  start();
  const std::size_t n = cuda::kMaxPooledBlocks + 1;
  std::vector<Storages> storages;
  for (std::size_t i = 0; i < n; ++i) storages.emplace_back(0, std::vector<std::size_t>{4096, 777}, 20 + i);
  HostArena arena(0, 8u << 20, PinMode::kRegister);
  std::vector<std::uintptr_t> regions;
  for (auto& s : storages) regions.push_back(arena.allocate(s.extent));
  const std::uintptr_t user = sim::stream_create(0);
  const auto held = sim::gate(stream(0, kKernelD2H));
  const std::size_t before = sim::calls("cuMemHostAlloc");
  std::vector<cuda::EventPtr> events;
  for (std::size_t i = 0; i + 1 < n; ++i) {
    events.push_back(storages[i].plan(kGather).run(Direction::kToHost, regions[i], user, {}, false));
  }
  std::atomic<bool> returned{false};
  cuda::EventPtr last;
  std::thread t([&] {
    last = storages[n - 1].plan(kGather).run(Direction::kToHost, regions[n - 1], user, {}, false);
    returned = true;
  });
  pause();
  CHECK(!returned);  // every table is busy: the batch waits for the oldest instead of pinning another
  sim::release(held);
  t.join();
  events.push_back(last);
  for (auto& e : events) e->synchronize();
  CHECK(sim::calls("cuMemHostAlloc") - before == cuda::kMaxPooledBlocks);
  for (std::size_t i = 0; i < n; ++i) CHECK(storages[i].host_is(regions[i], 20 + i));
  CHECK(sim::spinning_waits() == 0);  // the wait for the oldest table, and the caller's, sleep
}

TEST_CASE(sim_multi_device_plans) {
  sim::Config c;
  c.num_devices = 2;
  start(c);
  Storages s0(0, kMixed, 30), s1(1, kMixed, 31);
  HostArena arena(0, 16u << 20, PinMode::kRegister);
  const std::uintptr_t r0 = arena.allocate(s0.extent), r1 = arena.allocate(s1.extent);
  const std::uintptr_t u0 = sim::stream_create(0), u1 = sim::stream_create(1);
  CHECK(cuda::engine_streams(0) != cuda::engine_streams(1));
  sim::set_delay(stream(0, kCopyD2H), 0.2);
  cuda::EventPtr e0 = s0.plan(kGather).run(Direction::kToHost, r0, u0, {}, true);
  cuda::EventPtr e1 = s1.plan(kGather).run(Direction::kToHost, r1, u1, {}, true);
  CHECK(e0->device() == 0 && e1->device() == 1);
  // Device 1 restores what device 0 is still copying out: its batch waits on device 0's event.
  Storages into(1, kMixed, 0);
  CopyPlan restore(1, into.ptrs, s0.offsets, into.sizes, kGather);
  restore.run(Direction::kToDevice, r0, u1, {e0}, true)->synchronize();
  CHECK(into.device_is(30));
  e1->synchronize();
  CHECK(s1.host_is(r1, 31));
  CHECK(sim::sticky_error(0) == 0 && sim::sticky_error(1) == 0);
}

TEST_CASE(sim_pinning_before_any_device_creates_no_context) {
  sim::Config c;
  c.num_devices = 2;
  start(c);
  HostArena arena(0, 4u << 20, PinMode::kRegister);
  arena.reserve(1u << 20);  // a slab, before any device is in use
  CHECK(!drv::primary_context_active(0) && !drv::primary_context_active(1));
  CHECK(sim::calls("cuMemHostRegister") == 0);
  CHECK(cuda::info().num_deferred_pins == 1);
  const std::uintptr_t region = arena.allocate(1u << 20);
  CHECK(!sim::host_mapped(region, 1u << 20));
  // The tensors live on GPU 1: its first copy registers the slab under GPU 1's context; GPU 0 stays untouched.
  Storages s(1, {4096, 50000}, 40);
  s.plan(kGather).run(Direction::kToHost, region, sim::stream_create(1), {}, true)->synchronize();
  CHECK(sim::calls("cuMemHostRegister") == 1);
  CHECK(sim::host_mapped(region, 1u << 20));
  CHECK(s.host_is(region, 40));
  CHECK(drv::primary_context_active(1));
  CHECK(!drv::primary_context_active(0));
  CHECK(cuda::info().num_deferred_pins == 0);
  arena.free(region);
  CHECK(arena.trim() > 0);  // unregistered again
  CHECK(sim::calls("cuMemHostUnregister") == 1);
  CHECK(!drv::primary_context_active(0));
}

TEST_CASE(sim_capture_is_refused_before_anything_is_enqueued) {
  start();
  Storages s(0, {4096, 70000}, 41);
  HostArena arena(0, 4u << 20, PinMode::kRegister);
  const std::uintptr_t region = arena.allocate(s.extent);
  const std::uintptr_t user = sim::stream_create(0);
  cuda::engine_streams(0);
  sim::begin_capture(user, drv::kCaptureModeGlobal);
  const std::size_t records = sim::calls("cuEventRecord"), waits = sim::calls("cuStreamWaitEvent");
  std::string error;
  try {
    s.plan(kGather).run(Direction::kToHost, region, user, {}, true);
  } catch (const Error& e) {
    error = e.what();
  }
  CHECK(error.find("capturing a CUDA graph") != std::string::npos);
  CHECK(error.find("gpu_offload.join()") != std::string::npos);
  std::string checksum_error;
  try {
    cuda::checksum_device_async(0, s.ptrs, s.sizes, user);
  } catch (const Error& e) {
    checksum_error = e.what();
  }
  CHECK(checksum_error.find("capturing a CUDA graph") != std::string::npos);
  CHECK(sim::calls("cuEventRecord") == records && sim::calls("cuStreamWaitEvent") == waits);
  CHECK(sim::calls("cuLaunchKernel") == 0);
  CHECK(sim::capture_status(user) == drv::kCaptureStatusActive);  // the capture is intact
  sim::end_capture(user);
  s.plan(kGather).run(Direction::kToHost, region, user, {}, true)->synchronize();
  CHECK(s.host_is(region, 41));
}

TEST_CASE(sim_helper_thread_queries_do_not_break_a_capture) {
  start();
  Storages s(0, {4096}, 42);
  HostArena arena(0, 4u << 20, PinMode::kRegister);
  const std::uintptr_t region = arena.allocate(s.extent);
  cuda::EventPtr done = s.plan(0).run(Direction::kToHost, region, sim::stream_create(0), {}, true);
  const std::uintptr_t capturing = sim::stream_create(0);
  sim::begin_capture(capturing, drv::kCaptureModeGlobal);
  bool ok = true;
  std::thread t([&] {  // a stager's worker, a _reap from another thread
    try {
      done->synchronize();
      ok = done->query();
      cuda::engine_synchronize(0, true);
    } catch (const Error& e) {
      std::printf("  %s\n", e.what());
      ok = false;
    }
  });
  t.join();
  CHECK(ok);
  CHECK(sim::capture_status(capturing) == drv::kCaptureStatusActive);
  sim::end_capture(capturing);
}

TEST_CASE(sim_engine_synchronize_waits_for_one_direction) {
  sim::Config c;
  c.num_devices = 2;
  start(c);
  cuda::engine_synchronize(1, true);  // no engine on GPU 1 yet: nothing to wait for, nothing created
  CHECK(!drv::primary_context_active(1));
  Storages s(0, kMixed, 43);
  HostArena arena(0, 8u << 20, PinMode::kRegister);
  const std::uintptr_t region = arena.allocate(s.extent);
  std::memset(reinterpret_cast<void*>(region), 0, s.extent);
  const auto held = sim::gate(stream(0, kKernelD2H));
  cuda::EventPtr lost = s.plan(kGather).run(Direction::kToHost, region, sim::stream_create(0), {}, true);
  lost.reset();  // an interrupt dropped the event: the belt is engine_synchronize
  std::atomic<bool> returned{false};
  std::thread t([&] {
    cuda::engine_synchronize(0, true);
    returned = true;
  });
  pause();
  CHECK(!returned);
  cuda::engine_synchronize(0, false);  // the other direction has nothing pending
  sim::release(held);
  t.join();
  CHECK(s.host_is(region, 43));
}

TEST_CASE(sim_event_synchronize_blocks_until_the_copy_ran) {
  start();
  Storages s(0, {1u << 20}, 44);
  HostArena arena(0, 4u << 20, PinMode::kRegister);
  const std::uintptr_t region = arena.allocate(s.extent);
  const auto held = sim::gate(stream(0, kCopyD2H));
  cuda::EventPtr done = s.plan(0).run(Direction::kToHost, region, sim::stream_create(0), {}, true);
  std::atomic<bool> returned{false};
  std::thread t([&] {
    done->synchronize();
    returned = true;
  });
  pause();
  CHECK(!returned && !done->query());
  sim::release(held);
  t.join();
  CHECK(done->query() && s.host_is(region, 44));
  CHECK(sim::calls("cuEventSynchronize") >= 1 && sim::spinning_waits() == 0);  // it slept: blocking sync
}

TEST_CASE(sim_checksum_kernel_matches_the_host) {
  start();
  Storages s(0, {0, 1, 7, 4096, 3u << 20, 12345}, 45);
  const std::uintptr_t user = sim::stream_create(0);
  // Misaligned starts take the kernel's 8-byte and byte paths.
  std::vector<std::uintptr_t> ptrs = s.ptrs;
  std::vector<std::size_t> sizes = s.sizes;
  ptrs.push_back(s.ptrs[4] + 3);
  sizes.push_back(100000);
  ptrs.push_back(s.ptrs[4] + 8);
  sizes.push_back(2u << 20);
  const auto device = cuda::checksum_device(0, ptrs, sizes, user);
  CHECK(device == checksum_host(ptrs, sizes));
  CHECK(sim::kernel_launches() == 1);
}

TEST_CASE(sim_checksum_pool_is_bounded) {
  start();
  Storages s(0, {4096, 1u << 20}, 46);
  const std::uintptr_t user = sim::stream_create(0);
  sim::set_delay(user, 0.01);
  const std::size_t before = sim::calls("cuMemHostAlloc");
  std::vector<std::shared_ptr<cuda::ChecksumJob>> jobs;
  std::vector<std::vector<std::uint64_t>> expected;
  std::vector<unsigned char> first(s.sizes[0]);
  for (std::size_t i = 0; i < cuda::kMaxPooledBlocks + 4; ++i) {
    // Each job sums other data (the stream rewrites the first storage before it), so sums read out of
    // the wrong block are wrong.
    sim::enqueue_fill(0, user, s.ptrs[0], static_cast<unsigned char>(i + 1), s.sizes[0]);
    std::memset(first.data(), static_cast<int>(i + 1), first.size());
    expected.push_back(checksum_host({reinterpret_cast<std::uintptr_t>(first.data()), s.ptrs[1]}, s.sizes));
    jobs.push_back(cuda::checksum_device_async(0, s.ptrs, s.sizes, user));
  }
  CHECK(sim::calls("cuMemHostAlloc") - before == cuda::kMaxPooledBlocks);
  for (std::size_t i = 0; i < jobs.size(); ++i) CHECK(jobs[i]->wait() == expected[i]);  // taken-over blocks too
  CHECK(sim::spinning_waits() == 0);  // waits for a taken-over block and for the sums sleep
}

TEST_CASE(sim_kernels_off_leaves_the_copy_engines) {
  sim::Config c;
  c.kernels = "off";
  start(c);
  Storages s(0, kMixed, 47);
  HostArena arena(0, 8u << 20, PinMode::kRegister);
  const std::uintptr_t region = arena.allocate(s.extent);
  CHECK(!cuda::can_gather(0, region));
  s.plan(kGather).run(Direction::kToHost, region, sim::stream_create(0), {}, true)->synchronize();
  CHECK(s.host_is(region, 47));
  CHECK(sim::kernel_launches() == 0);
  const auto info = cuda::info();
  CHECK(info.devices.size() == 1 && info.devices[0].source == "none" && !info.devices[0].error.empty());
  std::string error;
  try {
    cuda::checksum_device(0, s.ptrs, s.sizes, 0);
  } catch (const Error& e) {
    error = e.what();
  }
  CHECK(error.find("checksum kernel") != std::string::npos);
}

TEST_CASE(sim_gather_into_unregistered_memory_is_refused) {
  start();
  Storages s(0, {4096}, 48);
  cuda::engine_streams(0);
  std::vector<unsigned char> pageable(s.extent);
  const auto region = reinterpret_cast<std::uintptr_t>(pageable.data());
  CHECK(!cuda::can_gather(0, region));
  CHECK_THROWS(cuda::copy_batch(0, s.batch(true, region, kGather), sim::stream_create(0), {}, true));
  // The copy engines take pageable memory (the driver stages it).
  s.plan(kGather).run(Direction::kToHost, region, sim::stream_create(0), {}, true)->synchronize();
  CHECK(s.host_is(region, 48));
}

TEST_CASE(sim_kernels_from_the_fatbin) {
  if (!cuda::has_fatbin()) {
    std::printf("  this build has no fatbin (no nvcc at build time)\n");
    g_skip = true;
    return;
  }
  sim::Config c;
  c.kernels = "real";
  start(c);
  Storages s(0, {4096, 9000}, 49);
  HostArena arena(0, 4u << 20, PinMode::kRegister);
  const std::uintptr_t region = arena.allocate(s.extent);
  s.plan(kGather).run(Direction::kToHost, region, sim::stream_create(0), {}, true)->synchronize();
  CHECK(s.host_is(region, 49));
  const auto info = cuda::info();
  CHECK(info.devices.size() == 1 && info.devices[0].source == "fatbin");
  CHECK(sim::kernel_launches() == 1);
}

TEST_CASE(sim_kernels_from_nvrtc) {
  // With GPU_OFFLOAD_NVRTC pointing at a libnvrtc (CI installs nvidia-cuda-nvrtc-cu12), the kernel source is
  // compiled for the simulated sm_90 and the simulator checks it got a cubin with both entry points.
  if (std::getenv("GPU_OFFLOAD_NVRTC") == nullptr) {
    std::printf("  GPU_OFFLOAD_NVRTC is not set\n");
    g_skip = true;
    return;
  }
  setenv("GPU_OFFLOAD_KERNELS", "nvrtc", 1);
  char cache[] = "/tmp/gpu_offload_kernel_cache_XXXXXX";  // empty: the first device compiles
  CHECK(mkdtemp(cache) != nullptr);
  setenv("GPU_OFFLOAD_CACHE_DIR", cache, 1);
  sim::Config c;
  c.kernels = "real";
  c.num_devices = 2;
  start(c);
  CHECK(!cuda::find_nvrtc().path.empty());
  Storages s(0, {4096, 9000}, 50);
  HostArena arena(0, 4u << 20, PinMode::kRegister);
  const std::uintptr_t region = arena.allocate(s.extent);
  s.plan(kGather).run(Direction::kToHost, region, sim::stream_create(0), {}, true)->synchronize();
  CHECK(s.host_is(region, 50));
  const auto info = cuda::info();
  CHECK(info.devices.size() == 1);
  if (!info.devices.empty()) {
    std::printf("  kernels: %s %s %s\n", info.devices[0].source.c_str(), info.devices[0].arch.c_str(),
                info.devices[0].error.c_str());
    CHECK(info.devices[0].source == "nvrtc");
  }
  // A damaged cache file (a crash mid-write on another file system, a full disk): the second device's load
  // refuses it, compiles again and rewrites the cache.
  const std::string dir = cuda::kernel_cache_dir();
  std::vector<std::string> cached;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) {
      if (std::strncmp(e->d_name, "kernels-", 8) == 0) cached.push_back(dir + "/" + e->d_name);
    }
    closedir(d);
  }
  CHECK(cached.size() == 1);
  for (const std::string& f : cached) {
    std::FILE* out = std::fopen(f.c_str(), "wb");
    std::fputs("not a cubin", out);
    std::fclose(out);
  }
  Storages s1(1, {4096, 9000}, 51);
  const std::uintptr_t region1 = arena.allocate(s1.extent);
  s1.plan(kGather).run(Direction::kToHost, region1, sim::stream_create(1), {}, true)->synchronize();
  CHECK(s1.host_is(region1, 51));
  const auto info1 = cuda::info();
  CHECK(info1.devices.size() == 2);
  if (info1.devices.size() == 2) CHECK(info1.devices[1].source == "nvrtc");
  for (const std::string& f : cached) {
    char head[4] = {0};
    std::FILE* in = std::fopen(f.c_str(), "rb");
    CHECK(in != nullptr && std::fread(head, 1, 4, in) == 4 && std::memcmp(head, "\x7f" "ELF", 4) == 0);
    if (in != nullptr) std::fclose(in);
    std::remove(f.c_str());
  }
  std::remove(dir.c_str());  // remove(3) takes empty folders too
  std::remove(cache);
}

int main(int argc, char** argv) {
  const int rc = check::run_all(argc, argv);
  return rc == 0 && g_skip ? 77 : rc;
}
