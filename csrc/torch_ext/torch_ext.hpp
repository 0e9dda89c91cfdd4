// Shared by the torch-aware helper's translation units.
#pragma once

#include <Python.h>

namespace c10 {
struct StorageImpl;
}

namespace gpu_offload::torch_ext {

// The StorageImpl behind a tensor, an UntypedStorage or a storage's _cdata (see torch_ext.cpp).
c10::StorageImpl* storage_of(PyObject* item);

}  // namespace gpu_offload::torch_ext
