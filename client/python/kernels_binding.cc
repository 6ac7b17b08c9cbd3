// The kernels (kernels/) for Python: block selection, the CPU reference attention forward and
// backward, exact recall, and the CUDA entry points (device pointers as integers, e.g. a torch
// tensor's data_ptr()). CPU tensors arrive through the buffer protocol (numpy arrays, or
// tensor.numpy() of contiguous float32 torch tensors) and are used in place: no copies, and
// outputs are written into the caller's buffers. The GIL is released while kernels run.
// Also the contract's kept-block rule and profile-table format (contract/), so that a trainer's
// own kernel gets the same per-row budgets and its profile the same text as sb-profile's.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "client/python/bindings.h"
#include "client/python/record.h"
#include "contract/block_geometry.h"
#include "contract/profile_format.h"
#include "contract/selection_mode.h"
#include "kernels/attention_cpu.h"
#include "kernels/block_index.h"
#include "kernels/block_selection.h"
#include "kernels/cuda_attention.h"

namespace sparsebalance {
namespace python {
namespace {

using kernels::BlockIndex;
using kernels::Selection;

// A C-contiguous buffer of T (float32 or int32) held for the duration of a call.
template <typename T>
class BufferView {
 public:
  BufferView(const py::buffer& buffer, const char* name, bool writable) {
    try {
      info_ = buffer.request(writable);
    } catch (py::error_already_set& e) {
      throw py::value_error(
          absl::StrCat(name, ": not a ", writable ? "writable " : "", "buffer (", e.what(), ")"));
    }
    const std::string& format = info_.format;
    const char want = py::format_descriptor<std::remove_const_t<T>>::c;
    const bool format_ok =
        !format.empty() && format.back() == want &&
        (format.size() == 1 ||
         (format.size() == 2 && (format[0] == '<' || format[0] == '=' || format[0] == '@')));
    if (!format_ok || info_.itemsize != static_cast<py::ssize_t>(sizeof(T))) {
      throw py::value_error(absl::StrCat(name, ": dtype '", format, "' where ",
                                         want == 'f' ? "float32" : "int32",
                                         " is needed (convert it first)"));
    }
    py::ssize_t expected = info_.itemsize;
    for (py::ssize_t d = info_.ndim - 1; d >= 0; --d) {
      if (info_.shape[d] != 1 && info_.strides[d] != expected) {
        throw py::value_error(absl::StrCat(name, ": not C-contiguous (call .contiguous())"));
      }
      expected *= info_.shape[d];
    }
  }
  absl::Span<T> span() const {
    return absl::Span<T>(static_cast<T*>(info_.ptr), static_cast<size_t>(info_.size));
  }

 private:
  py::buffer_info info_;
};

using In = BufferView<const float>;

// Token-weighted mean of a per-row value over every (sequence, head, query block) row.
double TokenWeighted(const BlockIndex& index, absl::Span<const float> row_values) {
  if (row_values.size() != static_cast<size_t>(index.rows())) {
    throw py::value_error(absl::StrCat("values: ", row_values.size(),
                                       " entries where the index has ", index.rows(), " rows"));
  }
  double sum = 0.0, weight = 0.0;
  for (int s = 0; s < index.sequences(); ++s) {
    for (int h = 0; h < index.heads; ++h) {
      for (int32_t i = 0; i < index.blocks(s); ++i) {
        const double tokens =
            std::min<int64_t>(index.block_size, index.length(s) - int64_t{i} * index.block_size);
        sum += tokens * row_values[index.RowId(s, h, i)];
        weight += tokens;
      }
    }
  }
  return weight > 0 ? sum / weight : 1.0;
}

// Token-weighted share of the causal key blocks kept.
double AchievedDensity(const BlockIndex& index) {
  std::vector<float> density(index.rows());
  for (int s = 0; s < index.sequences(); ++s) {
    for (int h = 0; h < index.heads; ++h) {
      for (int32_t i = 0; i < index.blocks(s); ++i) {
        const int64_t row = index.RowId(s, h, i);
        density[row] = static_cast<float>(index.row_ptr[row + 1] - index.row_ptr[row]) / (i + 1);
      }
    }
  }
  return TokenWeighted(index, density);
}

// A numpy array holding a copy of `values` with C-order `shape` (default: one dimension).
// numpy itself makes it from a memoryview: pybind11 2.10's own array constructors read numpy 1's
// descriptor layout, and under numpy 2 they give arrays of zeros or zero strides.
template <typename T>
py::object ToArray(const std::vector<T>& values, std::vector<py::ssize_t> shape = {}) {
  if (shape.empty()) shape.push_back(static_cast<py::ssize_t>(values.size()));
  std::vector<py::ssize_t> strides(shape.size());
  py::ssize_t stride = sizeof(T);
  for (size_t d = shape.size(); d-- > 0;) {
    strides[d] = stride;
    stride *= shape[d];
  }
  py::module_ numpy = py::module_::import("numpy");
  if (values.empty()) {  // a memoryview needs a non-null buffer
    return numpy.attr("zeros")(py::cast(shape),
                               py::arg("dtype") = py::format_descriptor<T>::format());
  }
  return numpy.attr("array")(py::memoryview::from_buffer(values.data(), shape, strides));
}

void CheckSequence(const BlockIndex& index, int seq, int head) {
  if (seq < 0 || seq >= index.sequences()) {
    throw py::index_error(absl::StrCat("seq ", seq, " not in [0, ", index.sequences(), ")"));
  }
  if (head < 0 || head >= index.heads) {
    throw py::index_error(absl::StrCat("head ", head, " not in [0, ", index.heads, ")"));
  }
}

// Device addresses arrive from Python as integers (tensor.data_ptr()); turning them back into
// pointers is what these entry points are for.
const void* Pointer(uintptr_t address) {
  return reinterpret_cast<const void*>(address);  // NOLINT(performance-no-int-to-ptr)
}
void* MutablePointer(uintptr_t address) {
  return reinterpret_cast<void*>(address);  // NOLINT(performance-no-int-to-ptr)
}

// The selection mode a Python argument names: "topk" or "anchor" (or a SelectionMode); a
// ValueError naming `name` otherwise.
SelectionMode SelectionModeArg(const py::object& value, const char* name) {
  if (py::isinstance<py::str>(value)) {
    const std::string text = value.cast<std::string>();
    if (text == "topk") return SelectionMode::kTopK;
    if (text == "anchor") return SelectionMode::kAnchor;
    throw py::value_error(
        absl::StrCat(name, ": '", text, "' is not a selection mode ('topk' or 'anchor')"));
  }
  try {
    return value.cast<SelectionMode>();
  } catch (const py::cast_error&) {
    throw py::value_error(absl::StrCat(name, ": ", py::str(py::repr(value)).cast<std::string>(),
                                       " is not a selection mode ('topk' or 'anchor')"));
  }
}

// The block selection settings select_blocks and cuda_select_blocks take (threads: CPU only,
// 0 = the hardware concurrency). ValueError naming the argument for a bad mode or threshold.
kernels::SelectionOptions MakeSelectionOptions(int block_size, int local_blocks,
                                               double mass_threshold, float softmax_scale,
                                               const py::object& selection, double anchor_threshold,
                                               int threads = 0) {
  kernels::SelectionOptions options;
  options.block_size = block_size;
  options.local_blocks = local_blocks;
  options.mass_threshold = mass_threshold;
  options.softmax_scale = softmax_scale;
  options.mode = SelectionModeArg(selection, "selection");
  if (!(anchor_threshold > 0.0 && anchor_threshold <= 1.0)) {
    throw py::value_error(absl::StrCat("anchor_threshold: ", anchor_threshold,
                                       " is not in (0, 1] (tau: a kept block's estimated weight "
                                       "relative to the best anchor block's)"));
  }
  options.anchor_threshold = anchor_threshold;
  options.threads = threads;
  return options;
}

void BindSelection(py::module_& m) {
  py::class_<Selection, std::shared_ptr<Selection>>(m, "Selection", R"(The kept key blocks of
every (sequence, head, query block) row (the CSR/CSC block index) and each row's estimated
recall. Made by select_blocks (or make_selection); passed to attention_forward/backward.)")
      .def_property_readonly("block_size", [](const Selection& s) { return s.index.block_size; })
      .def_property_readonly("heads", [](const Selection& s) { return s.index.heads; })
      .def_property_readonly("sequences", [](const Selection& s) { return s.index.sequences(); })
      .def_property_readonly("total_tokens",
                             [](const Selection& s) { return s.index.total_tokens(); })
      .def_property_readonly(
          "rows", [](const Selection& s) { return s.index.rows(); },
          "CSR rows: sum over sequences of their blocks, times heads")
      .def_property_readonly(
          "active_blocks", [](const Selection& s) { return s.index.active_blocks(); },
          "kept (query block, key block) pairs over all rows")
      .def_property_readonly("cu_seqlens",
                             [](const Selection& s) { return ToArray(s.index.cu_seqlens); })
      .def_property_readonly("cu_blocks",
                             [](const Selection& s) { return ToArray(s.index.cu_blocks); })
      .def_property_readonly(
          "row_ptr", [](const Selection& s) { return ToArray(s.index.row_ptr); },
          "CSR offsets (rows + 1) into col_idx")
      .def_property_readonly(
          "col_idx", [](const Selection& s) { return ToArray(s.index.col_idx); },
          "kept key block within its sequence, ascending within a row")
      .def_property_readonly(
          "estimated_recall", [](const Selection& s) { return ToArray(s.estimated_recall); },
          "per row: the block scores' estimate of the softmax mass kept (empty for "
          "make_selection)")
      .def(
          "row_id",
          [](const Selection& s, int seq, int head, int32_t block) {
            CheckSequence(s.index, seq, head);
            if (block < 0 || block >= s.index.blocks(seq)) {
              throw py::index_error(
                  absl::StrCat("block ", block, " not in [0, ", s.index.blocks(seq), ")"));
            }
            return s.index.RowId(seq, head, block);
          },
          py::arg("seq"), py::arg("head"), py::arg("block"))
      .def(
          "block_mask",
          [](const Selection& s, int seq, int head) {
            CheckSequence(s.index, seq, head);
            const int32_t n = s.index.blocks(seq);
            std::vector<uint8_t> mask(static_cast<size_t>(n) * n, 0);
            for (int32_t i = 0; i < n; ++i) {
              const int64_t row = s.index.RowId(seq, head, i);
              for (int64_t e = s.index.row_ptr[row]; e < s.index.row_ptr[row + 1]; ++e) {
                mask[static_cast<size_t>(i) * n + s.index.col_idx[e]] = 1;
              }
            }
            return ToArray(mask, {n, n});
          },
          py::arg("seq"), py::arg("head"),
          "uint8 [blocks, blocks] of sequence `seq`, head `head`: 1 where query block i keeps "
          "key block j (causal masking inside the diagonal block still applies).")
      .def(
          "token_weighted",
          [](const Selection& s, const py::buffer& values) {
            BufferView<const float> view(values, "values", false);
            return TokenWeighted(s.index, view.span());
          },
          py::arg("values"),
          "Token-weighted mean of a float32 value per row (e.g. exact_recall's answer).")
      .def_property_readonly(
          "recall",
          [](const Selection& s) {
            if (s.estimated_recall.empty()) return std::numeric_limits<double>::quiet_NaN();
            return TokenWeighted(s.index, s.estimated_recall);
          },
          "token-weighted estimated recall (NaN for make_selection)")
      .def_property_readonly(
          "achieved_density", [](const Selection& s) { return AchievedDensity(s.index); },
          "token-weighted share of the causal key blocks kept");
}

void BindCpuKernels(py::module_& m) {
  m.def(
      "select_blocks",
      [](const std::vector<int32_t>& cu_seqlens, int heads, int head_dim, const py::buffer& q,
         const py::buffer& k, const std::vector<double>& densities, int block_size,
         int local_blocks, double mass_threshold, float softmax_scale, int threads,
         const py::object& selection_mode, double anchor_threshold) {
        const kernels::SelectionOptions options =
            MakeSelectionOptions(block_size, local_blocks, mass_threshold, softmax_scale,
                                 selection_mode, anchor_threshold, threads);
        In qv(q, "q", false), kv(k, "k", false);
        absl::StatusOr<Selection> selection = WithoutGil([&] {
          return kernels::SelectBlocks(cu_seqlens, heads, head_dim, qv.span(), kv.span(), densities,
                                       options);
        });
        return std::make_shared<Selection>(ValueOrThrow(std::move(selection), ErrorKind::kKernel));
      },
      py::arg("cu_seqlens"), py::arg("heads"), py::arg("head_dim"), py::arg("q"), py::arg("k"),
      py::arg("densities"), py::arg("block_size") = 64, py::arg("local_blocks") = 1,
      py::arg("mass_threshold") = 1.0, py::arg("softmax_scale") = 0.0f, py::arg("threads") = 0,
      py::arg("selection") = "topk", py::arg("anchor_threshold") = kDefaultAnchorThreshold,
      "Selects the kept key blocks of every row on the CPU. q, k: float32 [total_tokens, heads, "
      "head_dim]; densities: one per sequence, in (0, 1]. selection: 'topk' (k_i blocks per "
      "row) or 'anchor' (at most k_i, only blocks scoring >= the best anchor's + "
      "ln(anchor_threshold)).");

  m.def(
      "make_selection",
      [](const std::vector<int32_t>& cu_seqlens, int heads, int block_size,
         const std::vector<std::vector<int32_t>>& rows) {
        absl::StatusOr<BlockIndex> index =
            kernels::MakeBlockIndex(cu_seqlens, heads, block_size, rows);
        auto selection = std::make_shared<Selection>();
        selection->index = ValueOrThrow(std::move(index), ErrorKind::kKernel);
        return selection;
      },
      py::arg("cu_seqlens"), py::arg("heads"), py::arg("block_size"), py::arg("rows"),
      "A Selection from explicit kept key blocks per row (rows[Selection.row_id(s, h, i)], "
      "ascending, each in [0, i]).");

  m.def(
      "attention_forward",
      [](const Selection& selection, int head_dim, const py::buffer& q, const py::buffer& k,
         const py::buffer& v, const py::buffer& out, const py::buffer& lse, float softmax_scale,
         int threads) {
        In qv(q, "q", false), kv(k, "k", false), vv(v, "v", false);
        BufferView<float> ov(out, "out", true), lv(lse, "lse", true);
        kernels::AttentionOptions options;
        options.softmax_scale = softmax_scale;
        options.threads = threads;
        absl::Status status = WithoutGil([&] {
          return kernels::AttentionForward(selection.index, head_dim, qv.span(), kv.span(),
                                           vv.span(), options, ov.span(), lv.span());
        });
        ThrowIfError(status, ErrorKind::kKernel);
      },
      py::arg("selection"), py::arg("head_dim"), py::arg("q"), py::arg("k"), py::arg("v"),
      py::arg("out"), py::arg("lse"), py::arg("softmax_scale") = 0.0f, py::arg("threads") = 0,
      "Block-sparse causal attention forward (CPU, fp32): writes out [total_tokens, heads, "
      "head_dim] and lse [heads, total_tokens] in place.");

  m.def(
      "attention_backward",
      [](const Selection& selection, int head_dim, const py::buffer& q, const py::buffer& k,
         const py::buffer& v, const py::buffer& out, const py::buffer& lse, const py::buffer& dout,
         const py::buffer& dq, const py::buffer& dk, const py::buffer& dv, float softmax_scale,
         int threads) {
        In qv(q, "q", false), kv(k, "k", false), vv(v, "v", false), ov(out, "out", false),
            lv(lse, "lse", false), dov(dout, "dout", false);
        BufferView<float> dqv(dq, "dq", true), dkv(dk, "dk", true), dvv(dv, "dv", true);
        kernels::AttentionOptions options;
        options.softmax_scale = softmax_scale;
        options.threads = threads;
        absl::Status status = WithoutGil([&] {
          return kernels::AttentionBackward(selection.index, head_dim, qv.span(), kv.span(),
                                            vv.span(), ov.span(), lv.span(), dov.span(), options,
                                            dqv.span(), dkv.span(), dvv.span());
        });
        ThrowIfError(status, ErrorKind::kKernel);
      },
      py::arg("selection"), py::arg("head_dim"), py::arg("q"), py::arg("k"), py::arg("v"),
      py::arg("out"), py::arg("lse"), py::arg("dout"), py::arg("dq"), py::arg("dk"), py::arg("dv"),
      py::arg("softmax_scale") = 0.0f, py::arg("threads") = 0,
      "Gradients of sum(out * dout) w.r.t. q, k, v (CPU, fp32), written into dq, dk, dv.");

  m.def(
      "exact_recall",
      [](const Selection& selection, int head_dim, const py::buffer& q, const py::buffer& k,
         float softmax_scale, int threads) {
        In qv(q, "q", false), kv(k, "k", false);
        absl::StatusOr<std::vector<float>> recall = WithoutGil([&] {
          return kernels::ExactRecall(selection.index, head_dim, qv.span(), kv.span(),
                                      softmax_scale, threads);
        });
        return ToArray(ValueOrThrow(std::move(recall), ErrorKind::kKernel));
      },
      py::arg("selection"), py::arg("head_dim"), py::arg("q"), py::arg("k"),
      py::arg("softmax_scale") = 0.0f, py::arg("threads") = 0,
      "Per row, the exact softmax mass inside the kept blocks (O(tokens^2): tests, small runs).");
}

void BindCudaKernels(py::module_& m) {
  namespace cuda = kernels::cuda;
  m.def("cuda_compiled", &cuda::Compiled, "Whether the CUDA kernels were built in.");
  m.def(
      "cuda_device_count",
      [] {
        std::string why;
        const int count = cuda::DeviceCount(&why);
        return std::make_pair(count, why);
      },
      "(devices usable now, why none when 0).");

  py::class_<cuda::DeviceBlockIndex, std::unique_ptr<cuda::DeviceBlockIndex>>(
      m, "CudaBlockIndex", "A Selection's block index copied to the GPU.")
      .def(py::init([](const Selection& selection, uintptr_t stream) {
             absl::StatusOr<cuda::DeviceBlockIndex> index = WithoutGil([&] {
               return cuda::DeviceBlockIndex::Upload(selection.index,
                                                     cuda::Stream{MutablePointer(stream)});
             });
             return std::make_unique<cuda::DeviceBlockIndex>(
                 ValueOrThrow(std::move(index), ErrorKind::kKernel));
           }),
           py::arg("selection"), py::arg("stream") = 0);

  py::class_<cuda::DeviceSelection, std::shared_ptr<cuda::DeviceSelection>>(
      m, "CudaSelection", R"(What cuda_select_blocks keeps, on the GPU: the block index (`index`,
for cuda_forward/cuda_backward) and each row's estimated recall. Only counts come to the host
unless asked: `recall()` reads the per-row estimates, `download()` the whole selection.)")
      .def_property_readonly(
          "index", [](const cuda::DeviceSelection& s) { return &s.index; },
          py::return_value_policy::reference_internal, "the CudaBlockIndex on the GPU")
      .def_property_readonly(
          "active_blocks", [](const cuda::DeviceSelection& s) { return s.index.active_blocks(); },
          "kept (query block, key block) pairs over all rows")
      .def(
          "recall",
          [](const cuda::DeviceSelection& s, uintptr_t stream) {
            std::vector<float> rows(static_cast<size_t>(s.index.shape().rows()));
            absl::Status status = WithoutGil([&] {
              return rows.empty()
                         ? absl::OkStatus()
                         : s.estimated_recall.CopyToHost(rows.data(), rows.size() * sizeof(float),
                                                         cuda::Stream{MutablePointer(stream)});
            });
            ThrowIfError(status, ErrorKind::kKernel);
            return TokenWeighted(s.index.shape(), rows);
          },
          py::arg("stream") = 0,
          "Token-weighted estimated recall (as Selection.recall); waits for `stream`.")
      .def(
          "download",
          [](const cuda::DeviceSelection& s, uintptr_t stream) {
            absl::StatusOr<Selection> host =
                WithoutGil([&] { return s.Download(cuda::Stream{MutablePointer(stream)}); });
            return std::make_shared<Selection>(ValueOrThrow(std::move(host), ErrorKind::kKernel));
          },
          py::arg("stream") = 0,
          "The whole selection on the host (a Selection); waits for `stream`.");

  m.def(
      "cuda_select_blocks",
      [](const std::vector<int32_t>& cu_seqlens, int heads, int head_dim, uintptr_t q, uintptr_t k,
         const std::vector<double>& densities, int block_size, int local_blocks,
         double mass_threshold, float softmax_scale, const py::object& selection_mode,
         double anchor_threshold, uintptr_t stream) {
        const kernels::SelectionOptions options =
            MakeSelectionOptions(block_size, local_blocks, mass_threshold, softmax_scale,
                                 selection_mode, anchor_threshold);
        absl::StatusOr<cuda::DeviceSelection> selection = WithoutGil([&] {
          return cuda::SelectBlocks(cu_seqlens, heads, head_dim, Pointer(q), Pointer(k), densities,
                                    options, cuda::Stream{MutablePointer(stream)});
        });
        return std::make_shared<cuda::DeviceSelection>(
            ValueOrThrow(std::move(selection), ErrorKind::kKernel));
      },
      py::arg("cu_seqlens"), py::arg("heads"), py::arg("head_dim"), py::arg("q"), py::arg("k"),
      py::arg("densities"), py::arg("block_size") = 64, py::arg("local_blocks") = 1,
      py::arg("mass_threshold") = 1.0, py::arg("softmax_scale") = 0.0f,
      py::arg("selection") = "topk", py::arg("anchor_threshold") = kDefaultAnchorThreshold,
      py::arg("stream") = 0,
      "Block selection on the GPU, entirely there (selection, anchor_threshold: as "
      "select_blocks): returns a CudaSelection. q, k: device addresses of bf16 [total_tokens, "
      "heads, head_dim] tensors (tensor.data_ptr()); stream: a cudaStream_t address "
      "(torch.cuda.current_stream().cuda_stream; 0 the legacy default stream).");

  m.def(
      "cuda_forward",
      [](const cuda::DeviceBlockIndex& index, int head_dim, uintptr_t q, uintptr_t k, uintptr_t v,
         float softmax_scale, uintptr_t out, uintptr_t lse, uintptr_t stream) {
        absl::Status status = WithoutGil([&] {
          return cuda::Forward(index, head_dim, Pointer(q), Pointer(k), Pointer(v), softmax_scale,
                               MutablePointer(out), static_cast<float*>(MutablePointer(lse)),
                               cuda::Stream{MutablePointer(stream)});
        });
        ThrowIfError(status, ErrorKind::kKernel);
      },
      py::arg("index"), py::arg("head_dim"), py::arg("q"), py::arg("k"), py::arg("v"),
      py::arg("softmax_scale"), py::arg("out"), py::arg("lse"), py::arg("stream") = 0,
      "Forward on `stream` (a cudaStream_t address: torch.cuda.current_stream().cuda_stream; 0 "
      "the legacy default stream): out bf16, lse fp32 [heads, total_tokens] (addresses).");

  m.def(
      "cuda_backward",
      [](const cuda::DeviceBlockIndex& index, int head_dim, uintptr_t q, uintptr_t k, uintptr_t v,
         uintptr_t out, uintptr_t lse, uintptr_t dout, float softmax_scale, uintptr_t delta,
         uintptr_t dq, uintptr_t dk, uintptr_t dv, uintptr_t stream) {
        absl::Status status = WithoutGil([&] {
          return cuda::Backward(index, head_dim, Pointer(q), Pointer(k), Pointer(v), Pointer(out),
                                static_cast<const float*>(Pointer(lse)), Pointer(dout),
                                softmax_scale, static_cast<float*>(MutablePointer(delta)),
                                MutablePointer(dq), MutablePointer(dk), MutablePointer(dv),
                                cuda::Stream{MutablePointer(stream)});
        });
        ThrowIfError(status, ErrorKind::kKernel);
      },
      py::arg("index"), py::arg("head_dim"), py::arg("q"), py::arg("k"), py::arg("v"),
      py::arg("out"), py::arg("lse"), py::arg("dout"), py::arg("softmax_scale"), py::arg("delta"),
      py::arg("dq"), py::arg("dk"), py::arg("dv"), py::arg("stream") = 0,
      "Backward on `stream` (as cuda_forward): dq, dk, dv bf16; delta fp32 scratch [heads, "
      "total_tokens].");
}

void BindGeometry(py::module_& m) {
  m.def("quantize_density", &QuantizeDensity, py::arg("density"),
        "round(density * 65536) clamped to [1, 65536]: the density every count below uses.");
  m.def("kept_blocks", &KeptBlocks, py::arg("query_block"), py::arg("quantized_density"),
        py::arg("local_blocks") = 1,
        "k_i = clamp(ceil(q * (i+1) / 65536), anchors_i, i+1): key blocks query block i keeps.");
  m.def("active_blocks", &ActiveBlocks, py::arg("length"), py::arg("density"),
        py::arg("block_size") = 64, py::arg("local_blocks") = 1,
        "Sum of kept_blocks over a document's query blocks (the planner's A(L, rho)).");
  m.def(
      "kept_blocks_per_row",
      [](int64_t length, double density, int block_size, int local_blocks) {
        if (length < 0 || length > std::numeric_limits<int32_t>::max()) {
          throw py::value_error(absl::StrCat("length: ", length, " is not in [0, 2^31) tokens"));
        }
        if (block_size < 1) {
          throw py::value_error(absl::StrCat("block_size: ", block_size, " is not positive"));
        }
        const int64_t q = QuantizeDensity(density);
        const int64_t rows = QueryBlocks(length, block_size);
        std::vector<int32_t> kept(static_cast<size_t>(rows));
        for (int64_t i = 0; i < rows; ++i) {
          kept[i] = static_cast<int32_t>(KeptBlocks(i, q, local_blocks));
        }
        return ToArray(kept);
      },
      py::arg("length"), py::arg("density"), py::arg("block_size") = 64,
      py::arg("local_blocks") = 1,
      "int32 [ceil(length / block_size)]: kept_blocks of every query block of a document (the "
      "top-k budget per query block; sums to active_blocks).");
}

void BindProfileFormat(py::module_& m) {
  Record<ProfileRow>(m, "ProfileRow", "One measured grid point of a profile table.")
      .Field("length", &ProfileRow::length, "tokens")
      .Field("density", &ProfileRow::density, "(0, 1]")
      .Field("seconds", &ProfileRow::seconds, "one layer, forward + backward")
      .Done();
  Record<ProfileBreakdown>(m, "ProfileBreakdown",
                           "Where a row's time went (written as comments, not read back).")
      .Field("attention_seconds", &ProfileBreakdown::attention_seconds, "attention part")
      .Field("linear_seconds", &ProfileBreakdown::linear_seconds, "the GEMMs")
      .Field("active_blocks", &ProfileBreakdown::active_blocks, "kept blocks over all heads")
      .Done();
  Record<ProfileTable>(m, "ProfileTable",
                       "A profile table (sb-profile's output, PlannerClient.upload_profile's "
                       "input): one-layer times over lengths x densities on one device.")
      .Field("device", &ProfileTable::device, "the device measured, one line")
      .Field("shape", &ProfileTable::shape, "ModelShape (layers unused: rows are per layer)")
      .Field("note", &ProfileTable::note, "one comment line on how rows were measured")
      .Field("rows", &ProfileTable::rows, "list of ProfileRow")
      .Field("breakdown", &ProfileTable::breakdown,
             "empty, or one ProfileBreakdown per row (not read back)")
      .Done();
  m.def(
      "parse_profile_table",
      [](const std::string& text) {
        return ValueOrThrow(ParseProfileTable(text), ErrorKind::kPlanner);
      },
      py::arg("text"),
      "Parses a profile table's text; PlannerError INVALID_ARGUMENT naming the line if bad.");
  m.def("format_profile_table", &FormatProfileTable, py::arg("table"),
        "The text of a ProfileTable (what sb-profile writes and upload_profile takes).");
}

}  // namespace

void BindKernels(py::module_& m) {
  BindSelection(m);
  BindCpuKernels(m);
  BindCudaKernels(m);
  BindGeometry(m);
  BindProfileFormat(m);
}

}  // namespace python
}  // namespace sparsebalance
