// The JSON of a dict of names whose values are a few shared objects (adapters/fsdp.py shard_info_json: an
// FSDP2 model's shard info maps each parameter's name to one of a few layout dicts). json.dumps walks every
// value (about 2 us each); Python's join of the sorted names with each distinct value's text, made once,
// still cost 35-55 ms for 65536 names (sorting, an encode and an f-string per name). Here the names are
// sorted as bytes (a radix quicksort: they share long prefixes) and the text written once into a str of its
// size: 5-6 ms for 65536 names and 9 MB of text (18-20 ms with std::sort and a growing buffer decoded at the
// end), the same text (tested against json.dumps).
//
// Also the names of a target's parts joined under their prefixes (adapters._recorded_parts: "1.state.7.exp_avg"
// for [model, optimizer]), one allocation a name where a Python f-string took about 130 ns.
#include <Python.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "py_objects.hpp"

namespace py = pybind11;

namespace gpu_offload::torch_ext {

namespace {

// Whether json.dumps writes this str as itself in quotes: ASCII, no quote, backslash or control character.
bool plain_json_str(PyObject* s, std::string_view* out) {
  if (!PyUnicode_CheckExact(s) || !PyUnicode_IS_ASCII(s)) return false;
  const char* data = reinterpret_cast<const char*>(PyUnicode_1BYTE_DATA(s));
  const size_t size = static_cast<size_t>(PyUnicode_GET_LENGTH(s));
  for (size_t i = 0; i < size; ++i) {
    const unsigned char c = static_cast<unsigned char>(data[i]);
    if (c < 0x20 || c == '"' || c == '\\' || c == 0x7f) return false;
  }
  *out = std::string_view(data, size);
  return true;
}

using Item = std::pair<std::string_view, PyObject*>;

// The byte at `depth` of an item's name, -1 past its end (a prefix sorts first).
inline int byte_at(const Item& item, size_t depth) {
  return depth < item.first.size() ? static_cast<unsigned char>(item.first[depth]) : -1;
}

// Sorts items by name, bytewise, every name sharing its first `depth` bytes: a three-way radix quicksort
// (Bentley and Sedgewick), which compares each byte of a common prefix once per partition level rather than
// once per comparison. A model's names share long prefixes ("blocks.12.experts.34.weight"): std::sort's
// comparisons re-read them, 15-20 ms for 65536 names.
void sort_names(Item* items, size_t n, size_t depth) {
  while (n > 1) {
    if (n < 12) {  // (a short run: insertion by the rest of each name)
      for (size_t i = 1; i < n; ++i) {
        for (size_t j = i; j > 0 && items[j].first.substr(std::min(depth, items[j].first.size())) <
                                        items[j - 1].first.substr(std::min(depth, items[j - 1].first.size()));
             --j) {
          std::swap(items[j], items[j - 1]);
        }
      }
      return;
    }
    std::swap(items[0], items[n / 2]);
    const int pivot = byte_at(items[0], depth);
    // items[0, lt) < pivot, [lt, i) == pivot, (gt, n) > pivot.
    size_t lt = 0, i = 1, gt = n - 1;
    while (i <= gt) {
      const int c = byte_at(items[i], depth);
      if (c < pivot) {
        std::swap(items[lt++], items[i++]);
      } else if (c > pivot) {
        std::swap(items[i], items[gt]);
        if (gt-- == 0) break;
      } else {
        ++i;
      }
    }
    // The three parts: below, equal (sorted further by the next byte, unless the names end here: equal, at
    // most one in a dict), above. The largest is sorted by this loop and the others, each at most half, by
    // recursion, which then goes no deeper than log2(n) calls.
    struct Part {
      Item* at;
      size_t n, depth;
    } parts[3] = {{items, lt, depth}, {items + lt, pivot < 0 ? 0 : gt + 1 - lt, depth + 1},
                  {items + gt + 1, n - gt - 1, depth}};
    Part* largest = std::max_element(parts, parts + 3, [](const Part& a, const Part& b) { return a.n < b.n; });
    for (Part& part : parts) {
      if (&part != largest) sort_names(part.at, part.n, part.depth);
    }
    items = largest->at;
    n = largest->n;
    depth = largest->depth;
  }
}

}  // namespace

py::object json_object_of_texts(py::handle mapping, py::handle text_of) {
  if (!PyDict_CheckExact(mapping.ptr())) return py::none();
  const Py_ssize_t count = PyDict_GET_SIZE(mapping.ptr());
  // (name, value) with the dict's references held: text_of runs Python, which may change the dict.
  std::vector<Item> items;
  std::vector<py::object> held;
  items.reserve(static_cast<size_t>(count));
  held.reserve(2 * static_cast<size_t>(count));
  Py_ssize_t pos = 0;
  PyObject *key, *value;
  while (PyDict_Next(mapping.ptr(), &pos, &key, &value)) {
    std::string_view name;
    if (!plain_json_str(key, &name)) return py::none();
    held.push_back(py::reinterpret_borrow<py::object>(key));
    held.push_back(py::reinterpret_borrow<py::object>(value));
    items.emplace_back(name, value);
  }
  // sort_keys: by code point, which for ASCII is byte order (a prefix first).
  sort_names(items.data(), items.size(), 0);
  // Each distinct value's text, asked first (text_of runs Python), by value identity (the values are held);
  // then the whole text written once into a str of its exact size (a growing buffer, then a decode, copied
  // the 9 MB of a 65536-parameter model's text three more times).
  std::unordered_map<PyObject*, py::object> texts;
  std::vector<PyObject*> text_at(items.size());  // (borrowed from `texts`)
  size_t total = 2;  // (the braces)
  for (size_t i = 0; i < items.size(); ++i) {
    auto it = texts.find(items[i].second);
    if (it == texts.end()) {
      py::object text = py::reinterpret_borrow<py::object>(text_of)(py::handle(items[i].second));
      if (!PyUnicode_CheckExact(text.ptr()) || !PyUnicode_IS_ASCII(text.ptr())) return py::none();
      it = texts.emplace(items[i].second, std::move(text)).first;
    }
    text_at[i] = it->second.ptr();
    total += (i != 0 ? 2 : 0) + items[i].first.size() + 4 + static_cast<size_t>(PyUnicode_GET_LENGTH(text_at[i]));
  }
  PyObject* out = PyUnicode_New(static_cast<Py_ssize_t>(total), 127);
  if (out == nullptr) throw py::error_already_set();
  char* at = reinterpret_cast<char*>(PyUnicode_1BYTE_DATA(out));
  auto put = [&at](const char* data, size_t size) {
    std::memcpy(at, data, size);
    at += size;
  };
  put("{", 1);
  for (size_t i = 0; i < items.size(); ++i) {
    if (i != 0) put(", ", 2);
    put("\"", 1);
    put(items[i].first.data(), items[i].first.size());
    put("\": ", 3);
    put(reinterpret_cast<const char*>(PyUnicode_1BYTE_DATA(text_at[i])), static_cast<size_t>(PyUnicode_GET_LENGTH(text_at[i])));
  }
  put("}", 1);
  py::object text = py::reinterpret_steal<py::object>(out);
  if (at != reinterpret_cast<char*>(PyUnicode_1BYTE_DATA(out)) + total) {
    throw std::logic_error("json_object_of_texts: the text's size was miscounted");
  }
  return text;
}

py::object prefixed_names(py::handle prefix, py::handle names, Py_ssize_t start, Py_ssize_t stop) {
  if (!PyUnicode_CheckExact(prefix.ptr())) return py::none();
  if (!PyList_CheckExact(names.ptr())) throw py::type_error("prefixed_names: names must be a list");
  if (start < 0 || start > stop || stop > PyList_GET_SIZE(names.ptr())) {
    throw py::value_error("prefixed_names: need 0 <= start <= stop <= len(names)");
  }
  PyObject* head = prefix.ptr();
  const Py_ssize_t a = PyUnicode_GET_LENGTH(head);
  const Py_UCS4 head_max = PyUnicode_MAX_CHAR_VALUE(head);
  py::list out(static_cast<size_t>(stop - start));  // (made before the names are read: it may run the collector)
  PyObject** slots = reinterpret_cast<PyListObject*>(out.ptr())->ob_item;
  const Items items = items_of(names);
  constexpr Py_ssize_t kAhead = 8;  // (each name's object, scattered)
  for (Py_ssize_t i = start; i < stop; ++i) {
    if (i + kAhead < stop) __builtin_prefetch(items.data[i + kAhead]);
    PyObject* name = items.data[i];
    if (!PyUnicode_CheckExact(name)) return py::none();
    const Py_ssize_t b = PyUnicode_GET_LENGTH(name);
    const Py_UCS4 widest = std::max(head_max, PyUnicode_MAX_CHAR_VALUE(name));
    PyObject* full = PyUnicode_New(a + 1 + b, widest);
    if (full == nullptr) throw py::error_already_set();
    if (widest < 128) {  // ASCII, the usual case: plain bytes
      char* at = reinterpret_cast<char*>(PyUnicode_1BYTE_DATA(full));
      std::memcpy(at, PyUnicode_1BYTE_DATA(head), static_cast<size_t>(a));
      at[a] = '.';
      std::memcpy(at + a + 1, PyUnicode_1BYTE_DATA(name), static_cast<size_t>(b));
    } else if (PyUnicode_CopyCharacters(full, 0, head, 0, a) < 0 || PyUnicode_WriteChar(full, a, '.') < 0 ||
               PyUnicode_CopyCharacters(full, a + 1, name, 0, b) < 0) {
      Py_DECREF(full);
      throw py::error_already_set();
    }
    slots[i - start] = full;
  }
  return std::move(out);
}

}  // namespace gpu_offload::torch_ext
