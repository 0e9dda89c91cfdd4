// pybind11 bindings for the torch-free core, kept apart from it: the core sees pointers, byte counts,
// device ids and stream handles as integers, and nothing here knows about torch either.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "core/arena.hpp"
#include "core/checksum.hpp"
#include "core/copy_plan.hpp"
#include "core/cuda_backend.hpp"
#include "core/errors.hpp"
#include "core/thread_pool.hpp"

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
  m.def("cuda_runtime_version", &cuda::runtime_version);
  m.def("cuda_architectures", &cuda::architectures);
  m.def("available_host_memory", &available_host_memory);
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
      .def("query", &cuda::Event::query)
      .def("synchronize", &cuda::Event::synchronize, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("device", &cuda::Event::device);

  py::class_<HostArena>(m, "HostArena")
      .def(py::init([](std::size_t max_bytes, std::size_t min_slab_bytes, const std::string& pin_mode) {
             return new HostArena(max_bytes, min_slab_bytes, parse_pin_mode(pin_mode));
           }),
           py::arg("max_bytes"), py::arg("min_slab_bytes"), py::arg("pin_mode"))
      .def("allocate", &HostArena::allocate, py::arg("num_bytes"), py::call_guard<py::gil_scoped_release>())
      .def("free", &HostArena::free, py::arg("ptr"))
      .def("reserve", &HostArena::reserve, py::arg("num_bytes"), py::call_guard<py::gil_scoped_release>())
      .def("trim", &HostArena::trim, py::arg("first_slab") = 0, py::call_guard<py::gil_scoped_release>())
      .def("region_bytes", &HostArena::region_bytes, py::arg("ptr"))
      .def_property_readonly("pin_mode", [](const HostArena& a) { return to_string(a.pin_mode()); })
      .def("stats", [](const HostArena& a) {
        ArenaStats s = a.stats();
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
        return d;
      });
  m.attr("ARENA_ALIGNMENT") = HostArena::kAlignment;

  py::class_<CopyPlan>(m, "CopyPlan")
      .def(py::init<int, std::vector<std::uintptr_t>, std::vector<std::size_t>, std::vector<std::size_t>, std::size_t>(),
           py::arg("device"), py::arg("device_ptrs"), py::arg("host_offsets"), py::arg("sizes"),
           py::arg("gather_max_bytes") = 0)
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
          py::call_guard<py::gil_scoped_release>());

  // -- checksums (integrity) ------------------------------------------------------------------------
  m.def("checksum_host", &checksum_host, py::arg("ptrs"), py::arg("sizes"),
        "Checksums of host buffers (pointers and byte counts), one 64-bit value each.",
        py::call_guard<py::gil_scoped_release>());
  py::class_<cuda::ChecksumJob, std::shared_ptr<cuda::ChecksumJob>>(m, "ChecksumJob")
      .def("done", &cuda::ChecksumJob::query)
      .def("result", &cuda::ChecksumJob::wait, "Blocks until the sums are on the host; the checksums.",
           py::call_guard<py::gil_scoped_release>());
  m.def("checksum_device_async", &cuda::checksum_device_async, py::arg("device"), py::arg("ptrs"), py::arg("sizes"),
        py::arg("stream") = 0, "Enqueues the checksum kernel over device buffers on `stream`; a ChecksumJob.",
        py::call_guard<py::gil_scoped_release>());
  m.def("checksum_device", &cuda::checksum_device, py::arg("device"), py::arg("ptrs"), py::arg("sizes"),
        py::arg("stream") = 0, "Checksums of device buffers, computed on `stream` and waited for.",
        py::call_guard<py::gil_scoped_release>());
}
