// pybind11 bindings for the torch-free core, kept apart from it: the core sees pointers, byte counts,
// device ids and stream handles as integers, and nothing here knows about torch either.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <string>
#include <vector>

#include "core/arena.hpp"
#include "core/checksum.hpp"
#include "core/copy_plan.hpp"
#include "core/cuda_backend.hpp"
#include "core/errors.hpp"
#include "core/ledger.hpp"
#include "core/thread_pool.hpp"
#ifdef GPU_OFFLOAD_WITH_CUDA
#include "core/driver_api.hpp"
#include "core/sim_driver.hpp"
#endif

#ifndef GPU_OFFLOAD_VERSION
#define GPU_OFFLOAD_VERSION "0.0.0"
#endif

namespace py = pybind11;
using namespace gpu_offload;

namespace {

// The Python exception class every core Error becomes (gpu_offload.OffloadError, set at import).
py::object& error_type() {
  static py::object* type = new py::object(py::reinterpret_borrow<py::object>(PyExc_RuntimeError));
  return *type;
}

PinMode parse_pin_mode(const std::string& name) {
  if (name == "auto") return PinMode::kAuto;
  if (name == "none") return PinMode::kNone;
  if (name == "hostalloc") return PinMode::kHostAlloc;
  if (name == "register") return PinMode::kRegister;
  throw Error("unknown pin mode '" + name + "' (expected auto, none, hostalloc or register)");
}

// What runs: the driver, its entry points, where each device's kernels came from.
py::dict backend_info() {
  cuda::BackendInfo i;
  {
    py::gil_scoped_release release;  // loading the driver and finding NVRTC take a moment
    i = cuda::info();
  }
  py::dict d;
  d["driver"] = i.driver;
  d["driver_source"] = i.driver_source;
  d["driver_error"] = i.driver_error;
  d["driver_version"] = i.driver_version;
  d["device_count"] = i.device_count;
  d["entry_points"] = i.entry_points;
  d["missing_entry_points"] = i.missing_entry_points;
  d["batched_copies"] = i.batched_copies;
  d["fatbin_architectures"] = i.fatbin_architectures;
  d["nvrtc_path"] = i.nvrtc_path;
  d["nvrtc_version"] = i.nvrtc_version;
  d["nvrtc_error"] = i.nvrtc_error;
  d["kernel_cache_dir"] = i.kernel_cache_dir;
  py::list devices;
  for (const auto& k : i.devices) {
    py::dict e;
    e["device"] = k.device;
    e["source"] = k.source;
    e["arch"] = k.arch;
    e["error"] = k.error;
    e["gather_regs"] = k.gather_regs;
    e["checksum_regs"] = k.checksum_regs;
    devices.append(e);
  }
  d["devices"] = devices;
  d["num_deferred_pins"] = i.num_deferred_pins;
  d["num_failed_pins"] = i.num_failed_pins;
  d["pin_error"] = i.pin_error;
  d["num_batch_fallbacks"] = i.num_batch_fallbacks;
  d["batch_error"] = i.batch_error;
  return d;
}

#ifdef GPU_OFFLOAD_WITH_CUDA
// _C._sim: the simulated driver for tests (sim_driver.hpp). enable() must come before the first driver use.
void bind_sim(py::module_& m) {
  py::module_ s = m.def_submodule("_sim", "The simulated CUDA driver (tests): enable before the first driver use.");
  s.def(
      "enable",
      [](int num_devices, int driver_version, bool batch, int sm_count, int cc, const std::string& kernels) {
        sim::Config c;
        c.num_devices = num_devices;
        c.driver_version = driver_version;
        c.batch = batch;
        c.sm_count = sm_count;
        c.cc_major = cc / 10;
        c.cc_minor = cc % 10;
        c.kernels = kernels;
        if (sim::enabled()) return;  // already (the GPU_OFFLOAD_SIM environment variable, or an earlier call)
        GO_CHECK(sim::enable(c), "the simulated driver must be enabled before the first CUDA driver use");
      },
      py::arg("num_devices") = 1, py::arg("driver_version") = 13000, py::arg("batch") = true, py::arg("sm_count") = 4,
      py::arg("cc") = 90, py::arg("kernels") = "builtin");
  s.def("enabled", [] { return drv::driver_loaded() && sim::enabled(); });
  s.def("mem_alloc", &sim::mem_alloc, py::arg("device"), py::arg("num_bytes"));
  s.def("mem_free", &sim::mem_free, py::arg("ptr"));
  s.def("stream_create", &sim::stream_create, py::arg("device"));
  s.def("gate", &sim::gate, py::arg("stream"));
  s.def("release", &sim::release, py::arg("gate"));
  s.def("set_delay", &sim::set_delay, py::arg("stream"), py::arg("seconds"));
  s.def("enqueue_fill", &sim::enqueue_fill, py::arg("device"), py::arg("stream"), py::arg("ptr"), py::arg("value"),
        py::arg("num_bytes"));
  s.def("synchronize", &sim::synchronize, py::call_guard<py::gil_scoped_release>());
  s.def("block", &sim::block, py::arg("entry"), py::arg("nth"), py::arg("timeout_seconds"));
  s.def("parked", &sim::parked, py::arg("gate"));
  s.def("fail", &sim::fail, py::arg("entry"), py::arg("nth"), py::arg("result"));
  s.def("clear_failures", &sim::clear_failures);
  s.def("calls", &sim::calls, py::arg("entry"));
  s.def("begin_capture", &sim::begin_capture, py::arg("stream"), py::arg("mode") = 0);
  s.def("end_capture", &sim::end_capture, py::arg("stream"));
  s.def("capture_status", &sim::capture_status, py::arg("stream"));
  s.def("sticky_error", &sim::sticky_error, py::arg("device"));
  s.def("host_mapped", &sim::host_mapped, py::arg("ptr"), py::arg("num_bytes"));
  s.def("primary_context_active", &drv::primary_context_active, py::arg("device"));
  s.def("kernel_launches", &sim::kernel_launches);
  s.def("spinning_waits", &sim::spinning_waits);
  s.def(
      "read",
      [](std::uintptr_t ptr, std::size_t n) { return py::bytes(reinterpret_cast<const char*>(ptr), n); },
      py::arg("ptr"), py::arg("num_bytes"));
  s.def(
      "write",
      [](std::uintptr_t ptr, const py::bytes& data) {
        const std::string b = data;
        std::memcpy(reinterpret_cast<void*>(ptr), b.data(), b.size());
      },
      py::arg("ptr"), py::arg("data"));
}
#endif

// A contiguous buffer of native 64-bit addresses (bytes of uint64s) as a vector.
std::vector<std::uintptr_t> addresses_of(const py::buffer& ptrs, const char* what) {
  const py::buffer_info info = ptrs.request();
  const std::size_t nbytes = static_cast<std::size_t>(info.size * info.itemsize);
  if (info.ndim != 1 || info.strides[0] != info.itemsize || nbytes % sizeof(std::uintptr_t) != 0) {
    throw py::value_error(std::string(what) + ": expected a contiguous buffer of 64-bit addresses");
  }
  std::vector<std::uintptr_t> addresses(nbytes / sizeof(std::uintptr_t));
  if (nbytes != 0) std::memcpy(addresses.data(), info.ptr, nbytes);
  return addresses;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "gpu_offload core: pinned host arena and batched copy engine";

  m.def("_set_error_type", [](py::object type) { error_type() = std::move(type); });
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      PyErr_SetString(error_type().ptr(), e.what());
    }
  });

  m.def("version", [] { return std::string(GPU_OFFLOAD_VERSION); });
  m.def("cuda_compiled", &cuda::compiled);
  m.def("cuda_available", &cuda::available, py::call_guard<py::gil_scoped_release>());
  m.def("device_count", &cuda::device_count, py::call_guard<py::gil_scoped_release>());
  m.def("cuda_architectures", &cuda::architectures);
  m.def("cuda_info", &backend_info, "The CUDA driver, its entry points and each device's kernels (a dict).");
  m.def("_set_library_dirs", &cuda::set_library_dirs, py::arg("dirs"),
        "Folders such as site-packages/nvidia, searched for libnvrtc (read when NVRTC is first needed).");
  m.def("engine_synchronize", &cuda::engine_synchronize, py::arg("device"), py::arg("to_host"),
        "Waits for everything enqueued on the device's copy-engine and kernel streams of one direction.",
        py::call_guard<py::gil_scoped_release>());
  m.def("available_host_memory", &available_host_memory);
  m.def("host_memory_limit", &host_memory_limit,
        "MemTotal, or the memory cgroup's limit where that is lower (what a fractional node budget is of).");
  m.def("process_host_memory", [] {
    HostMemoryStats s = process_host_memory();
    py::dict d;
    d["pinned_bytes"] = s.pinned_bytes;
    d["registered_bytes"] = s.registered_bytes;
    d["pageable_bytes"] = s.pageable_bytes;
    d["bytes_by_numa_node"] = s.bytes_by_numa_node;
    return d;
  }, "Host memory held by every arena of this process, by kind and by the NUMA node its pages are on.");
  m.def("node_ledger_configure", [](const std::string& dir, std::size_t max_bytes) {
    NodeLedger::instance().configure(dir, max_bytes);
  }, py::arg("dir"), py::arg("max_bytes"), "Where the node's ledger lives and this process's budget (0: none).");
  m.def("node_ledger_state", [] {
    LedgerState s;
    {
      py::gil_scoped_release release;  // the file lock may wait for another process
      s = NodeLedger::instance().state();
    }
    py::dict d, by_pid;
    d["max_bytes"] = s.max_bytes;
    d["reserved_bytes"] = s.reserved_bytes;
    d["own_bytes"] = s.own_bytes;
    d["path"] = s.path;
    for (const auto& u : s.users) by_pid[py::int_(u.pid)] = u.bytes;
    d["by_pid"] = by_pid;
    return d;
  }, "The node's live reservations (dead processes' shares are taken back first).");
  m.def("engine_streams", &cuda::engine_streams, py::arg("device"),
        "The engine's streams on a device as cudaStream_t integers: copy D2H, copy H2D, kernel D2H, kernel H2D.",
        py::call_guard<py::gil_scoped_release>());
  m.def("host_threads", [] { return ThreadPool::instance().num_threads(); },
        "Threads of the host copy pool (GPU_OFFLOAD_NUM_THREADS, default the cores, at most 16).");
  m.def(
      "host_memoryview",
      [](std::uintptr_t ptr, std::size_t num_bytes) {
        return py::memoryview::from_memory(reinterpret_cast<void*>(ptr), static_cast<py::ssize_t>(num_bytes), false);
      },
      "A writable view of host memory the caller owns (an arena region); it must not outlive the region.");

  py::class_<cuda::Event, cuda::EventPtr>(m, "Event")
      .def("query", &cuda::Event::query, py::call_guard<py::gil_scoped_release>())
      .def("synchronize", &cuda::Event::synchronize, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("device", &cuda::Event::device);

  py::class_<HostArena>(m, "HostArena")
      .def(py::init([](std::size_t max_bytes, std::size_t min_slab_bytes, const std::string& pin_mode) {
             return new HostArena(max_bytes, min_slab_bytes, parse_pin_mode(pin_mode));
           }),
           py::arg("max_bytes"), py::arg("min_slab_bytes"), py::arg("pin_mode"))
      // Every method that takes the arena's mutex releases the GIL: another thread may hold it for seconds
      // while it pins a slab, and waiting for it with the GIL would freeze every Python thread.
      .def("allocate", &HostArena::allocate, py::arg("num_bytes"), py::arg("numa_node") = HostArena::kAnyNode,
           py::call_guard<py::gil_scoped_release>())
      .def("free", &HostArena::free, py::arg("ptr"), py::call_guard<py::gil_scoped_release>())
      .def("reserve", &HostArena::reserve, py::arg("num_bytes"), py::arg("numa_node") = HostArena::kAnyNode,
           py::call_guard<py::gil_scoped_release>())
      .def("take_notes", &HostArena::take_notes, py::call_guard<py::gil_scoped_release>())  // waits on a pin
      .def("trim", &HostArena::trim, py::arg("first_slab") = 0, py::call_guard<py::gil_scoped_release>())
      .def("region_bytes", &HostArena::region_bytes, py::arg("ptr"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("pin_mode",
                             [](const HostArena& a) {
                               PinMode mode;
                               {
                                 py::gil_scoped_release release;
                                 mode = a.pin_mode();
                               }
                               return to_string(mode);
                             })
      .def("stats", [](const HostArena& a) {
        ArenaStats s;
        {
          py::gil_scoped_release release;
          s = a.stats();
        }
        py::dict d;
        d["capacity_bytes"] = s.capacity_bytes;
        d["used_bytes"] = s.used_bytes;
        d["max_bytes"] = s.max_bytes;
        d["num_slabs"] = s.num_slabs;
        d["num_regions"] = s.num_regions;
        d["num_free_blocks"] = s.num_free_blocks;
        d["largest_free_block_bytes"] = s.largest_free_block_bytes;
        d["num_slab_allocations"] = s.num_slab_allocations;
        d["pin_seconds"] = s.pin_seconds;
        d["bytes_by_numa_node"] = s.bytes_by_numa_node;
        return d;
      });
  m.attr("ARENA_ALIGNMENT") = HostArena::kAlignment;

  py::class_<CopyPlan>(m, "CopyPlan")
      .def(py::init<int, std::vector<std::uintptr_t>, std::vector<std::size_t>, std::vector<std::size_t>, std::size_t>(),
           py::arg("device"), py::arg("device_ptrs"), py::arg("host_offsets"), py::arg("sizes"),
           py::arg("gather_max_bytes") = 0)
      // The device addresses as a buffer of native uint64s (the torch-aware helper's
      // storage_data_ptrs_bytes()): no Python int per storage on a target's first call. (bytes is no sequence
      // to pybind11's list caster, so the overload above never takes it.)
      .def(py::init([](int device, const py::buffer& ptrs, std::vector<std::size_t> host_offsets,
                       std::vector<std::size_t> sizes, std::size_t gather_max_bytes) {
             return CopyPlan(device, addresses_of(ptrs, "CopyPlan"), std::move(host_offsets), std::move(sizes),
                             gather_max_bytes);
           }),
           py::arg("device"), py::arg("device_ptrs"), py::arg("host_offsets"), py::arg("sizes"),
           py::arg("gather_max_bytes") = 0)
      .def(
          "with_device_ptrs",
          [](const CopyPlan& plan, const py::buffer& ptrs) {
            // A buffer of native uint64 addresses (e.g. the torch-aware helper's storage_data_ptrs_bytes()),
            // not a list: no Python int per storage either way.
            return plan.with_device_ptrs(addresses_of(ptrs, "with_device_ptrs"));
          },
          py::arg("device_ptrs"),
          "The same copies with other device addresses (one per copy, as a buffer of native 64-bit addresses).")
      .def_property_readonly("num_kernel_copies", &CopyPlan::num_kernel_copies)
      .def_property_readonly("gather_max_bytes", &CopyPlan::gather_max_bytes)
      .def_property_readonly("device", &CopyPlan::device)
      .def_property_readonly("num_copies", &CopyPlan::num_copies)
      .def_property_readonly("total_bytes", &CopyPlan::total_bytes)
      .def_property_readonly("host_extent_bytes", &CopyPlan::host_extent_bytes)
      .def(
          "run",
          [](const CopyPlan& plan, bool to_host, std::uintptr_t host_base, std::uintptr_t stream,
             const std::vector<cuda::EventPtr>& waits, bool stream_waits) {
            return plan.run(to_host ? Direction::kToHost : Direction::kToDevice, host_base, stream, waits, stream_waits);
          },
          py::arg("to_host"), py::arg("host_base"), py::arg("stream") = 0,
          py::arg("waits") = std::vector<cuda::EventPtr>{}, py::arg("stream_waits") = true,
          py::call_guard<py::gil_scoped_release>())
      .def(
          "run_into",
          [](const CopyPlan& plan, const py::tuple& sinks, bool to_host, std::uintptr_t host_base,
             std::uintptr_t stream, const std::vector<cuda::EventPtr>& waits, bool stream_waits) {
            // "Enqueued" and "recorded" in one step: CPython raises a pending KeyboardInterrupt (a signal,
            // ray.cancel) as a C call returns and drops its result, so the event of a batch that is already
            // running would be lost with it. Here it is in the caller's lists before the call returns.
            std::vector<py::list> lists;
            lists.reserve(sinks.size());
            for (const auto& sink : sinks) {
              if (!py::isinstance<py::list>(sink)) throw py::type_error("run_into: sinks must be a tuple of lists");
              lists.push_back(py::reinterpret_borrow<py::list>(sink));
            }
            cuda::EventPtr event;
            {
              py::gil_scoped_release release;
              event = plan.run(to_host ? Direction::kToHost : Direction::kToDevice, host_base, stream, waits,
                               stream_waits);
            }
            if (!event) return;  // the host path: complete already
            try {
              py::object handle = py::cast(event);
              for (auto& list : lists) list.append(handle);
            } catch (...) {
              // The event cannot be handed over (out of memory): the caller would free the region under the
              // copy, so the copy must be over before the error reaches it.
              py::gil_scoped_release release;
              event->synchronize();
              throw;
            }
          },
          py::arg("sinks"), py::arg("to_host"), py::arg("host_base"), py::arg("stream") = 0,
          py::arg("waits") = std::vector<cuda::EventPtr>{}, py::arg("stream_waits") = true,
          "As run(), but appends the completion event (if any) to every list in `sinks` before returning, "
          "so that no interrupt can fall between the enqueue and its record; returns None.");

  // -- checksums (integrity) ------------------------------------------------------------------------
  m.def("checksum_host", &checksum_host, py::arg("ptrs"), py::arg("sizes"),
        "Checksums of host buffers (pointers and byte counts), one 64-bit value each.",
        py::call_guard<py::gil_scoped_release>());
  py::class_<cuda::ChecksumJob, std::shared_ptr<cuda::ChecksumJob>>(m, "ChecksumJob")
      .def("done", &cuda::ChecksumJob::query, py::call_guard<py::gil_scoped_release>())
      .def("result", &cuda::ChecksumJob::wait, "Blocks until the sums are on the host; the checksums.",
           py::call_guard<py::gil_scoped_release>());
  m.def("checksum_device_async", &cuda::checksum_device_async, py::arg("device"), py::arg("ptrs"), py::arg("sizes"),
        py::arg("stream") = 0, "Enqueues the checksum kernel over device buffers on `stream`; a ChecksumJob.",
        py::call_guard<py::gil_scoped_release>());
  m.def("checksum_device", &cuda::checksum_device, py::arg("device"), py::arg("ptrs"), py::arg("sizes"),
        py::arg("stream") = 0, "Checksums of device buffers, computed on `stream` and waited for.",
        py::call_guard<py::gil_scoped_release>());
#ifdef GPU_OFFLOAD_WITH_CUDA
  bind_sim(m);
#endif
}
