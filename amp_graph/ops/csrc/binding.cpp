// CUDA kernels of the amp_graph ops (schemas defined in amp_graph/ops/scaler_ops.py), registered with
// the dispatcher when this library is loaded. A thin layer over the C-ABI launchers of
// amp_kernels.cu: it fingerprints the gradient list (launch_plan.h), finds the launch plan and the
// device copy of its table in a cache (building and writing them only when the parameter set
// changed), takes the grid from the occupancy calculator (asked once per device and kernel) and
// launches once per dtype. No host synchronization, nothing that a CUDA graph capture forbids.
//
// The ops' AutogradCUDA kernels are registered here too, unboxed: gradients are data, never
// differentiated through, and an unboxed call (python_entry.cpp) then stays unboxed down to the
// kernel instead of passing every tensor through the boxed autograd fallback.
#include <ATen/core/Tensor.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/record_stream.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <array>
#include <functional>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "amp_kernels.h"
#include "launch_cache.h"
#include "launch_plan.h"
#include "list_ops.h"
#include "table_cache.h"
#include "tiling.h"

namespace {

int dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return AMP_GRAPH_FP32;
    case at::kHalf:
      return AMP_GRAPH_FP16;
    case at::kBFloat16:
      return AMP_GRAPH_BF16;
    default:
      return -1;
  }
}

// torch's Python name of a dtype ("torch.float64"), as the native path's errors print it.
std::string python_dtype(at::ScalarType t) {
  std::string name = c10::toString(t);  // "Double"
  switch (t) {
    case at::kDouble: return "torch.float64";
    case at::kFloat: return "torch.float32";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kLong: return "torch.int64";
    case at::kInt: return "torch.int32";
    case at::kShort: return "torch.int16";
    case at::kChar: return "torch.int8";
    case at::kByte: return "torch.uint8";
    case at::kBool: return "torch.bool";
    case at::kComplexFloat: return "torch.complex64";
    case at::kComplexDouble: return "torch.complex128";
    default: return name;
  }
}

constexpr size_t kCachedTables = 8;  // parameter sets kept (several optimizers, dtypes, ...)

struct DeviceTable {
  at::Tensor words;              // device copy of the plan's table
  amp_graph::LaunchPlan plan;    // rows and tiles per dtype, and the table's words on the host
  c10::cuda::CUDAStream alloc_stream;  // stream `words` was allocated on
  c10::cuda::CUDAEvent written;  // recorded after the last write outside a capture
  bool written_eagerly;          // false: only a captured graph writes it (at each replay)
};

// What a launch needs of a cached table, copied out under the cache's lock.
struct Launch {
  at::Tensor words;
  std::array<int64_t, amp_graph::kKernelDtypes> rows;
  std::array<int64_t, amp_graph::kKernelDtypes> tiles;
};

void write_table(DeviceTable& table, const c10::cuda::CUDAStream& stream, bool capturing) {
  const std::vector<int64_t>& words = table.plan.table;
  C10_CUDA_CHECK(static_cast<cudaError_t>(amp_graph_write_table(
      table.words.data_ptr<int64_t>(), words.data(), static_cast<int64_t>(words.size()), stream)));
  if (!capturing) {
    table.written.record(stream);
    table.written_eagerly = true;
  }
}

// The launch of `key` (a fingerprint, or a table's content): a cached plan whose device table is
// ready on `stream`, or, on a miss, the plan of build() with its table written on `stream`. A
// table used while `stream` is being captured into a CUDA graph is pinned: the graph reads it at
// every replay.
Launch cached_launch(const at::Device& device, const std::vector<int64_t>& key,
                     const c10::cuda::CUDAStream& stream,
                     const std::function<amp_graph::LaunchPlan()>& build) {
  static std::mutex* mutex = new std::mutex();  // leaked on purpose, like the cache: both must
  static auto* cache = new amp_graph::TableCache<DeviceTable>(kCachedTables);  // outlive exit
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  const bool capturing = capture != cudaStreamCaptureStatusNone;
  const std::lock_guard<std::mutex> lock(*mutex);
  auto* entry = cache->find(device.index(), key);
  if (entry == nullptr) {
    amp_graph::LaunchPlan plan = build();
    const auto size = static_cast<int64_t>(plan.table.size());
    DeviceTable table{at::empty({size}, at::TensorOptions().dtype(at::kLong).device(device)),
                      std::move(plan), stream, c10::cuda::CUDAEvent(cudaEventDisableTiming),
                      false};
    write_table(table, stream, capturing);
    entry = &cache->insert(device.index(), key, std::move(table), capturing);
  } else if (capturing) {
    // torch.cuda.graph synchronizes the device before capturing, so an earlier write is done.
    entry->pinned = true;
  } else if (!entry->buffer.written_eagerly) {
    write_table(entry->buffer, stream, false);  // built in a capture: no content until replay
  } else if (stream != entry->buffer.alloc_stream) {
    entry->buffer.written.block(stream);  // after the write, wherever it ran
    entry->buffer.words.record_stream(stream);  // and freed only after this stream's kernels
  }
  const DeviceTable& table = entry->buffer;
  return Launch{table.words, table.plan.rows, table.plan.tiles};
}

// Multiprocessors and resident blocks, asked of the CUDA runtime once per device and kernel.
struct RuntimeQuery {
  int sm_count(int device) {
    int count = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
    return count;
  }
  int blocks_per_sm(int device, int dtype, int mode) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    int blocks = 0;
    C10_CUDA_CHECK(static_cast<cudaError_t>(amp_graph_max_active_blocks(dtype, mode, &blocks)));
    return blocks;
  }
};

int64_t max_grid(const at::Device& device, int dtype, int mode) {
  static auto* cache = new amp_graph::LaunchCache<RuntimeQuery>(RuntimeQuery{});
  return cache->max_grid(device.index(), dtype, mode);
}

// The errors' texts are built from strings alone (std::to_string, Device::str, toString):
// on an H200 with torch 2.11+cu130, every ValueError whose message this library formatted
// with an integer through iostreams (a size, an index) crashed the process; one with none
// was raised. The cause was not found; tests/test_kernel_ops.py raises each error on a GPU.
std::string shape_text(const at::Tensor& t) {
  std::string text = "(";
  for (size_t d = 0; d < t.sizes().size(); ++d) {
    text += (d ? ", " : "") + std::to_string(t.sizes()[d]);
  }
  return text + (t.sizes().size() == 1 ? ",)" : ")");
}

void check_flag(const at::Tensor& t, const at::Device& device, const char* name) {
  // ValueError, like the checks of the native path (ops.py), with its text.
  TORCH_CHECK_VALUE(t.device() == device, name, " must be on ", device.str(), ", got ",
                    t.device().str());
  TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat && t.numel() == 1, name,
                    " must be a one-element float32 tensor, got ",
                    python_dtype(t.scalar_type()), " ", shape_text(t));
}

void bump_version(const at::Tensor& t) {
  if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
}

// The checks of one gradient (the native path's errors, ops.py), then what a fingerprint records.
amp_graph::TensorFacts facts_of(const at::Tensor& g, int64_t i, const at::Device& device) {
  TORCH_CHECK_VALUE(g.is_floating_point(),
                    "amp_graph gradient ops take floating-point tensors; grads[",
                    std::to_string(i), "] is ", python_dtype(g.scalar_type()));
  TORCH_CHECK_VALUE(g.device() == device, "amp_graph gradient ops take tensors on one device; "
                    "grads[", std::to_string(i), "] is on ", g.device().str(),
                    ", found_inf on ", device.str());
  const int64_t numel = g.numel();
  const bool dense = g.is_non_overlapping_and_dense();
  const int64_t addr = numel > 0 && dense ? reinterpret_cast<int64_t>(g.data_ptr()) : 0;
  return {addr, numel, dtype_code(g.scalar_type()), dense};
}

// mode: AMP_GRAPH_CHECK, AMP_GRAPH_UNSCALE or AMP_GRAPH_UNSCALE_NORM. Returns the float32 sum of
// squares of the unscaled values for AMP_GRAPH_UNSCALE_NORM, else an undefined tensor.
at::Tensor run(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor* inv_scale,
               int mode) {
  const at::Device device = found_inf.device();
  check_flag(found_inf, device, "found_inf");
  const bool writes = mode != AMP_GRAPH_CHECK;
  if (writes) check_flag(*inv_scale, device, "inv_scale");
  c10::cuda::CUDAGuard guard(device);
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(device.index());

  // The common case: every tensor dense and of a kernel dtype; its plan is found by fingerprint.
  thread_local std::vector<int64_t> key;
  const auto n = static_cast<int64_t>(grads.size());
  bool any_elements = false;  // else nothing to launch
  const bool fingerprinted = amp_graph::fingerprint(
      n,
      [&](int64_t i) {
        const amp_graph::TensorFacts facts = facts_of(grads[i], i, device);
        any_elements = any_elements || (facts.numel > 0 && facts.code >= 0);
        return facts;
      },
      key);

  // Otherwise: dense tensors (any order of strides) are processed in place as one flat span;
  // others go through a contiguous copy, written back afterwards. Other dtypes take torch's
  // native ops. The plan is built per call and the table keyed by its content.
  std::vector<at::Tensor> keep_alive;
  std::vector<std::pair<at::Tensor, at::Tensor>> write_back;
  std::vector<at::Tensor> other_dtypes;
  std::function<amp_graph::LaunchPlan()> build = [] {
    return amp_graph::plan_from_fingerprint(key);
  };
  if (!fingerprinted) {
    std::array<std::vector<amp_graph::TensorDesc>, amp_graph::kKernelDtypes> rows;
    for (const at::Tensor& g : grads) {
      const int code = dtype_code(g.scalar_type());
      if (code < 0) {
        other_dtypes.push_back(g);
        continue;
      }
      if (g.numel() == 0) continue;
      at::Tensor span = g;
      if (!g.is_non_overlapping_and_dense()) {
        span = g.contiguous();
        keep_alive.push_back(span);
        if (writes) write_back.emplace_back(g, span);
      }
      rows[code].push_back({reinterpret_cast<int64_t>(span.data_ptr()), span.numel(), 0});
    }
    auto plan = std::make_shared<amp_graph::LaunchPlan>(amp_graph::plan_from_rows(rows));
    key = plan->table;
    build = [plan] { return std::move(*plan); };
    any_elements = key.size() > static_cast<size_t>(amp_graph::kTableHeaderWords);
  }

  at::Tensor sum_of_squares;
  if (mode == AMP_GRAPH_UNSCALE_NORM) sum_of_squares = at::zeros({}, found_inf.options());
  const Launch launch = any_elements ? cached_launch(device, key, stream, build) : Launch{};
  const int64_t* table_rows =
      any_elements ? launch.words.data_ptr<int64_t>() + amp_graph::kTableHeaderWords : nullptr;
  for (int code = 0; any_elements && code < amp_graph::kKernelDtypes; ++code) {
    const int64_t rows = launch.rows[code];
    if (rows == 0) continue;
    const int grid =
        static_cast<int>(amp_graph::grid_size(launch.tiles[code], max_grid(device, code, mode)));
    at::Tensor partials;
    if (mode == AMP_GRAPH_UNSCALE_NORM) partials = at::empty({grid}, found_inf.options());
    const int err = amp_graph_launch_check_unscale(
        table_rows, rows, launch.tiles[code], code, mode, found_inf.data_ptr<float>(),
        writes ? inv_scale->data_ptr<float>() : nullptr,
        partials.defined() ? partials.data_ptr<float>() : nullptr, grid, stream);
    C10_CUDA_CHECK(static_cast<cudaError_t>(err));
    if (partials.defined()) sum_of_squares.add_(partials.sum());  // fixed grid: deterministic
    table_rows += 3 * rows;
  }
  for (auto& pair : write_back) pair.first.copy_(pair.second);

  if (!other_dtypes.empty()) {
    at::Tensor found = found_inf;  // a mutable handle for the native op's signature
    if (!writes) {
      for (const at::Tensor& g : other_dtypes) {
        found.masked_fill_(at::isfinite(g).all().logical_not(), 1.0);
      }
    } else {
      at::_amp_foreach_non_finite_check_and_unscale_(other_dtypes, found, *inv_scale);
      if (mode == AMP_GRAPH_UNSCALE_NORM) {
        // The native path's rule (ops.py): float32 squares, one sum per tensor, then their sum.
        std::vector<at::Tensor> sums;
        for (const at::Tensor& g : other_dtypes) sums.push_back(g.to(at::kFloat).square().sum());
        sum_of_squares.add_(at::stack(sums).sum());
      }
    }
  }

  bump_version(found_inf);
  if (writes) {
    for (const at::Tensor& g : grads) bump_version(g);
  }
  return sum_of_squares;
}

void non_finite_check_and_unscale_cuda(at::TensorList grads, const at::Tensor& found_inf,
                                       const at::Tensor& inv_scale) {
  run(grads, found_inf, &inv_scale, AMP_GRAPH_UNSCALE);
}

void non_finite_check_cuda(at::TensorList grads, const at::Tensor& found_inf) {
  run(grads, found_inf, nullptr, AMP_GRAPH_CHECK);
}

at::Tensor non_finite_check_unscale_and_norm_cuda(at::TensorList grads,
                                                  const at::Tensor& found_inf,
                                                  const at::Tensor& inv_scale) {
  return run(grads, found_inf, &inv_scale, AMP_GRAPH_UNSCALE_NORM);
}

void update_scale_cuda(const at::Tensor& scale, const at::Tensor& trackers,
                       const at::Tensor& found_inf, double growth_factor, double backoff_factor,
                       int64_t growth_interval, int64_t hysteresis, double min_scale,
                       double max_scale) {
  const at::Device device = scale.device();
  check_flag(scale, device, "scale");
  check_flag(found_inf, device, "found_inf");
  TORCH_CHECK_VALUE(trackers.device() == device && trackers.scalar_type() == at::kLong &&
                  trackers.numel() == amp_graph::kNumTrackers && trackers.is_contiguous(),
              "trackers must be a contiguous int64 tensor of ",
              std::to_string(amp_graph::kNumTrackers), " elements on ", device.str());
  const at::Tensor found = found_inf.contiguous();
  c10::cuda::CUDAGuard guard(device);
  const int err = amp_graph_launch_update_scale(
      scale.data_ptr<float>(), trackers.data_ptr<int64_t>(), found.data_ptr<float>(),
      growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale,
      c10::cuda::getCurrentCUDAStream(device.index()).stream());
  C10_CUDA_CHECK(static_cast<cudaError_t>(err));
  bump_version(scale);
  bump_version(trackers);
}

// AutogradCUDA kernels: below autograd at once (gradients are data; the ops return nothing
// differentiable), unboxed, without a pass over the tensors. The CUDA kernels bump the versions
// of what they write, as the ADInplaceOrView kernels of torch's in-place ops do.
void non_finite_check_and_unscale_autograd(c10::DispatchKeySet ks, at::TensorList grads,
                                           const at::Tensor& found_inf,
                                           const at::Tensor& inv_scale) {
  at::AutoDispatchBelowADInplaceOrView guard;
  amp_graph::non_finite_check_and_unscale_op().redispatch(
      ks & c10::after_ADInplaceOrView_keyset, grads, found_inf, inv_scale);
}

void non_finite_check_autograd(c10::DispatchKeySet ks, at::TensorList grads,
                               const at::Tensor& found_inf) {
  at::AutoDispatchBelowADInplaceOrView guard;
  amp_graph::non_finite_check_op().redispatch(ks & c10::after_ADInplaceOrView_keyset, grads,
                                              found_inf);
}

at::Tensor non_finite_check_unscale_and_norm_autograd(c10::DispatchKeySet ks,
                                                      at::TensorList grads,
                                                      const at::Tensor& found_inf,
                                                      const at::Tensor& inv_scale) {
  at::AutoDispatchBelowADInplaceOrView guard;
  return amp_graph::non_finite_check_unscale_and_norm_op().redispatch(
      ks & c10::after_ADInplaceOrView_keyset, grads, found_inf, inv_scale);
}

}  // namespace

TORCH_LIBRARY_IMPL(amp_graph, AutogradCUDA, m) {
  m.impl("non_finite_check_and_unscale_", TORCH_FN(non_finite_check_and_unscale_autograd));
  m.impl("non_finite_check_", TORCH_FN(non_finite_check_autograd));
  m.impl("non_finite_check_unscale_and_norm_",
         TORCH_FN(non_finite_check_unscale_and_norm_autograd));
}

TORCH_LIBRARY_IMPL(amp_graph, CUDA, m) {
  m.impl("non_finite_check_and_unscale_", &non_finite_check_and_unscale_cuda);
  m.impl("non_finite_check_", &non_finite_check_cuda);
  m.impl("non_finite_check_unscale_and_norm_", &non_finite_check_unscale_and_norm_cuda);
  m.impl("update_scale_", &update_scale_cuda);
}
