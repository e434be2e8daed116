// CPython binding of the planner (fi_backend._planner), stable ABI. Arrays come in through the buffer
// protocol (numpy arrays, memoryviews, ...: anything C-contiguous with int32 items), so nothing is
// copied and no numpy headers are needed. fi_backend/scheduler.py is the Python face of this module.
//
// The buffer protocol joined the limited API in Python 3.11 (PyObject_GetBuffer, Py_buffer), so the
// stable-ABI build needs Py_LIMITED_API >= 3.11; setup.py builds without the limited API on 3.10.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#if defined(Py_LIMITED_API) && Py_LIMITED_API + 0 < 0x030B0000
#error "planner_py.cc needs the buffer protocol: limited API from Python 3.11 (Py_LIMITED_API >= 0x030B0000)"
#endif

#include <cstddef>
#include <cstring>

#include "plan.h"
#include "scheduler/planner.h"

namespace {

// One planner per thread keeps its scratch arrays between calls: a plan in steady state allocates
// nothing.
thread_local fi::Planner g_planner;
// PlanInfo.kind's three values, made once (module init) so a plan returns them without allocating.
PyObject* g_kind_lpt = nullptr;
PyObject* g_kind_partition = nullptr;
PyObject* g_kind_deterministic = nullptr;

bool IsInt32Format(const char* format) {
  if (format == nullptr) return false;  // PyBUF_FORMAT was asked for, so this is unexpected
  if (format[0] == '@' || format[0] == '=' || format[0] == '<') ++format;
  if (std::strcmp(format, "i") == 0) return true;
  return sizeof(long) == 4 && std::strcmp(format, "l") == 0;
}

// Fills `view` with a C-contiguous int32 buffer of `obj` or sets an exception naming `name`.
bool GetInt32Buffer(PyObject* obj, const char* name, bool writable, Py_buffer* view) {
  int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
  if (PyObject_GetBuffer(obj, view, flags) != 0) {
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError, "%s must be a %sC-contiguous int32 array (numpy array or buffer), got %R", name,
                 writable ? "writable " : "", (PyObject*)Py_TYPE(obj));
    return false;
  }
  if (view->itemsize != 4 || !IsInt32Format(view->format)) {
    PyErr_Format(PyExc_TypeError, "%s must hold int32 items, got format '%s' with itemsize %zd", name,
                 view->format ? view->format : "?", view->itemsize);
    PyBuffer_Release(view);
    return false;
  }
  return true;
}

struct BufferGuard {
  Py_buffer* view;
  ~BufferGuard() {
    if (view != nullptr) PyBuffer_Release(view);
  }
};

PyObject* Plan(PyObject*, PyObject* args) {
  PyObject *section_obj, *qo_obj, *kv_obj;
  Py_ssize_t layout_ctas, max_items, max_rows, max_partial_rows, tile_q, num_ctas, num_units, min_kv_chunk,
      kv_chunk_align;
  Py_ssize_t force_kv_chunk = -1, force_split_pairs = -1, kv_window = 0, deterministic_pieces = 0;
  int causal, group_requests = 0, allow_partition = 1;
  double cost_q, cost_kv, shared_gain = fi::kSharedGain, cost_item_min = 0.0;
  PyObject* groups_obj = Py_None;
  if (!PyArg_ParseTuple(args, "OnnnnOOnnnpnndd|nnpnpnOdd:plan", &section_obj, &layout_ctas, &max_items, &max_rows,
                        &max_partial_rows, &qo_obj, &kv_obj, &tile_q, &num_ctas, &num_units, &causal, &min_kv_chunk,
                        &kv_chunk_align, &cost_q, &cost_kv, &force_kv_chunk, &force_split_pairs, &group_requests,
                        &kv_window, &allow_partition, &deterministic_pieces, &groups_obj, &shared_gain, &cost_item_min))
    return nullptr;
  if (!(shared_gain >= 0.0)) {
    PyErr_Format(PyExc_ValueError, "shared_gain must be >= 0, got %g", shared_gain);
    return nullptr;
  }
  Py_buffer groups;
  groups.obj = nullptr;
  const bool has_groups = groups_obj != Py_None;
  if (has_groups && !GetInt32Buffer(groups_obj, "groups", false, &groups)) return nullptr;
  BufferGuard g0{has_groups ? &groups : nullptr};
  if (has_groups && groups.len % 12 != 0) {
    PyErr_Format(PyExc_ValueError, "groups must hold (first, end, prefix_len) triples, got %zd int32", groups.len / 4);
    return nullptr;
  }

  Py_buffer section, qo, kv;
  if (!GetInt32Buffer(section_obj, "section", true, &section)) return nullptr;
  BufferGuard g1{&section};
  if (!GetInt32Buffer(qo_obj, "qo_indptr", false, &qo)) return nullptr;
  BufferGuard g2{&qo};
  if (!GetInt32Buffer(kv_obj, "kv_lens", false, &kv)) return nullptr;
  BufferGuard g3{&kv};

  const Py_ssize_t num_requests = kv.len / 4;
  if (qo.len / 4 != num_requests + 1) {
    PyErr_Format(PyExc_ValueError, "qo_indptr must have len(kv_lens) + 1 = %zd entries, got %zd", num_requests + 1,
                 qo.len / 4);
    return nullptr;
  }

  fi::PlanInputs in;
  in.qo_indptr = static_cast<const int32_t*>(qo.buf);
  in.kv_lens = static_cast<const int32_t*>(kv.buf);
  in.num_requests = num_requests;
  in.tile_q = tile_q;
  in.num_ctas = num_ctas;
  in.num_units = num_units;
  in.causal = causal != 0;
  in.min_kv_chunk = min_kv_chunk;
  in.kv_chunk_align = kv_chunk_align;
  in.cost_q = cost_q;
  in.cost_kv = cost_kv;
  in.cost_item_min = cost_item_min;
  in.force_kv_chunk = force_kv_chunk;
  in.force_split_pairs = force_split_pairs;
  in.group_requests = group_requests != 0;
  in.kv_window = kv_window;
  in.allow_partition = allow_partition != 0;
  in.deterministic_pieces = deterministic_pieces;
  if (has_groups) {
    in.groups = static_cast<const int32_t*>(groups.buf);
    in.num_groups = groups.len / 12;
    in.shared_gain = shared_gain;
  }
  fi::PlanSection out;
  out.data = static_cast<int32_t*>(section.buf);
  out.num_ints = section.len / 4;
  out.num_ctas = layout_ctas;
  out.max_items = max_items;
  out.max_rows = max_rows;
  out.max_partial_rows = max_partial_rows;

  fi::PlanSummary summary;
  if (g_planner.Plan(in, out, &summary) != fi::PlanStatus::kOk) {
    PyErr_SetString(PyExc_ValueError, g_planner.error());
    return nullptr;
  }
  return Py_BuildValue("(nnnnndnOn)", (Py_ssize_t)summary.num_items, (Py_ssize_t)summary.num_rows,
                       (Py_ssize_t)summary.num_partial_rows, (Py_ssize_t)summary.kv_chunk,
                       (Py_ssize_t)summary.num_split_rows, summary.makespan, (Py_ssize_t)summary.num_split_pairs,
                       summary.deterministic ? g_kind_deterministic
                                             : summary.partition ? g_kind_partition : g_kind_lpt,
                       (Py_ssize_t)summary.num_shared_groups);
}

// The plan.h offsets (int32 units) for a layout, so Python can check its own copy of the formulas.
PyObject* Layout(PyObject*, PyObject* args) {
  Py_ssize_t num_ctas, max_items, max_rows;
  if (!PyArg_ParseTuple(args, "nnn:layout", &num_ctas, &max_items, &max_rows)) return nullptr;
  return Py_BuildValue("(LLLLL)", (long long)fi_plan_cta_indptr_offset(),
                       (long long)fi_plan_merge_indptr_offset(num_ctas),
                       (long long)fi_plan_split_rows_offset(num_ctas, max_rows),
                       (long long)fi_plan_items_offset(num_ctas, max_rows),
                       (long long)fi_plan_ints(num_ctas, max_items, max_rows));
}

// FiWorkItem's fields as (name, offset in int32 units), so Python's record layout can be checked.
PyObject* ItemFields(PyObject*, PyObject*) {
#define FI_FIELD(f) #f, (Py_ssize_t)(offsetof(FiWorkItem, f) / 4)
  return Py_BuildValue("((sn)(sn)(sn)(sn)(sn)(sn)(sn)(sn))", FI_FIELD(request), FI_FIELD(q_begin), FI_FIELD(q_end),
                       FI_FIELD(kv_begin), FI_FIELD(kv_end), FI_FIELD(partial_base), FI_FIELD(partial_stride),
                       FI_FIELD(unit));
#undef FI_FIELD
}

PyMethodDef kMethods[] = {
    {"plan", Plan, METH_VARARGS,
     "plan(section, layout_num_ctas, max_items, max_rows, max_partial_rows, qo_indptr, kv_lens, tile_q, num_ctas, "
     "num_units, causal, min_kv_chunk, kv_chunk_align, cost_q, cost_kv[, force_kv_chunk=-1, force_split_pairs=-1, "
     "group_requests=False, kv_window=0, allow_partition=True, deterministic_pieces=0, groups=None, "
     "shared_gain=SHARED_GAIN, cost_item_min=0]) -> (num_items, "
     "num_rows, num_partial_rows, kv_chunk, num_split_rows, makespan, num_split_pairs, kind, shared_groups)\n\nWrites the plan into `section` (int32, csrc/plan.h "
     "layout) in place. force_kv_chunk -1 searches for the chunk; 0 splits nothing; L > 0 uses the candidate (L, "
     "force_split_pairs) (see csrc/scheduler/planner.h). kind: 'lpt' or 'partition'."},
    {"layout", Layout, METH_VARARGS,
     "layout(num_ctas, max_items, max_rows) -> (cta_indptr, merge_indptr, split_rows, items, total) offsets in "
     "int32 units, from csrc/plan.h"},
    {"item_fields", ItemFields, METH_NOARGS, "item_fields() -> ((name, offset in int32 units), ...) of FiWorkItem"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {
    PyModuleDef_HEAD_INIT, "_planner", "The load-balanced planner (Algorithm 1 of the FlashInfer paper).", -1,
    kMethods, nullptr, nullptr, nullptr, nullptr,
};

}  // namespace

PyMODINIT_FUNC PyInit__planner(void) {
  PyObject* m = PyModule_Create(&kModule);
  if (m == nullptr) return nullptr;
  struct {
    const char* name;
    long value;
  } constants[] = {
      {"HEADER_INTS", FI_PLAN_HEADER_INTS},
      {"ITEM_INTS", (long)(sizeof(FiWorkItem) / 4)},
      {"NUM_ITEMS", FI_PLAN_NUM_ITEMS},
      {"NUM_ROWS", FI_PLAN_NUM_ROWS},
      {"NUM_PARTIAL_ROWS", FI_PLAN_NUM_PARTIAL_ROWS},
      {"KV_CHUNK", FI_PLAN_KV_CHUNK},
      {"NUM_REQUESTS", FI_PLAN_NUM_REQUESTS},
      {"NUM_CTAS", FI_PLAN_NUM_CTAS},
      {"TILE_Q", FI_PLAN_TILE_Q},
      {"NUM_SPLIT_ROWS", FI_PLAN_NUM_SPLIT_ROWS},
      {"NUM_UNITS", FI_PLAN_NUM_UNITS},
      {"MAX_SPLIT_ITEMS_PER_CTA", (long)fi::kMaxSplitItemsPerCta},
      {"PARTITION_WALKS", (long)fi::kPartitionWalks},
      {"MAX_SHARED_CHUNKS", (long)fi::kMaxSharedChunks},
      {"ITEM_SHARED", (long)FI_ITEM_SHARED},
  };
  for (const auto& c : constants) {
    if (PyModule_AddIntConstant(m, c.name, c.value) != 0) {
      Py_DECREF(m);
      return nullptr;
    }
  }
  g_kind_lpt = PyUnicode_InternFromString("lpt");
  g_kind_partition = PyUnicode_InternFromString("partition");
  g_kind_deterministic = PyUnicode_InternFromString("deterministic");
  if (g_kind_lpt == nullptr || g_kind_partition == nullptr || g_kind_deterministic == nullptr) {
    Py_DECREF(m);
    return nullptr;
  }
  const struct {
    const char* name;
    double value;
  } reals[] = {{"BALANCED_SLACK", fi::kBalancedSlack}, {"PARTITION_PRECISION", fi::kPartitionPrecision},
                {"SHARED_GAIN", fi::kSharedGain}};
  for (const auto& c : reals) {
    PyObject* value = PyFloat_FromDouble(c.value);
    if (value == nullptr || PyModule_AddObject(m, c.name, value) != 0) {
      Py_XDECREF(value);
      Py_DECREF(m);
      return nullptr;
    }
  }
  return m;
}
