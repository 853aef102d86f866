// CUDA kernels of the amp_graph ops (schemas defined in amp_graph/kernels/ops.py), registered with
// the dispatcher when this library is loaded. A thin layer over the C-ABI launchers of
// amp_kernels.cu: it builds the per-dtype tensor table on the host (pinned memory), ships it to
// the device on the current stream and launches once per dtype. No host synchronization.
#include <ATen/core/Tensor.h>
#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/linalg_vector_norm.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <array>
#include <cstring>
#include <utility>
#include <vector>

#include "amp_kernels.h"
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

int sm_count(const at::Device& device) {
  int count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device.index()));
  return count;
}

void check_flag(const at::Tensor& t, const at::Device& device, const char* name) {
  TORCH_CHECK(t.device() == device, name, " must be on ", device, ", got ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.numel() == 1, name,
              " must be a one-element float32 tensor, got ", t.scalar_type(), " ", t.sizes());
}

void bump_version(const at::Tensor& t) {
  if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
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
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();

  // Dense tensors (any order of strides) are processed in place as one flat span; others go
  // through a contiguous copy, written back afterwards. Other dtypes take torch's native ops.
  std::vector<at::Tensor> keep_alive;
  std::vector<std::pair<at::Tensor, at::Tensor>> write_back;
  std::vector<at::Tensor> other_dtypes;
  std::array<std::vector<amp_graph::TensorDesc>, 3> rows;
  for (const at::Tensor& g : grads) {
    TORCH_CHECK(g.device() == device, "all grads must be on ", device, ", got ", g.device());
    const int code = dtype_code(g.scalar_type());
    if (code < 0) {
      TORCH_CHECK(g.is_floating_point(), "grads must be floating point, got ", g.scalar_type());
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

  at::Tensor sum_of_squares;
  if (mode == AMP_GRAPH_UNSCALE_NORM) sum_of_squares = at::zeros({}, found_inf.options());
  const int sms = sm_count(device);
  for (int code = 0; code < 3; ++code) {
    std::vector<amp_graph::TensorDesc>& table = rows[code];
    if (table.empty()) continue;
    const int64_t elem_bytes = code == AMP_GRAPH_FP32 ? 4 : 2;
    const int64_t n = static_cast<int64_t>(table.size());
    const int64_t total_tiles = amp_graph::build_tile_table(table.data(), n, elem_bytes);
    // Pinned staging + non_blocking copy: the caching host allocator keeps the staging block
    // alive until the copy has run, so nothing waits.
    at::Tensor host = at::empty({n * 3}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
    std::memcpy(host.data_ptr<int64_t>(), table.data(), sizeof(amp_graph::TensorDesc) * n);
    const at::Tensor dev_table = host.to(device, /*non_blocking=*/true);
    const int grid = amp_graph_grid_size(total_tiles, sms);
    at::Tensor partials;
    if (mode == AMP_GRAPH_UNSCALE_NORM) partials = at::empty({grid}, found_inf.options());
    const int err = amp_graph_launch_check_unscale(
        dev_table.data_ptr<int64_t>(), n, total_tiles, code, mode, found_inf.data_ptr<float>(),
        writes ? inv_scale->data_ptr<float>() : nullptr,
        partials.defined() ? partials.data_ptr<float>() : nullptr, grid, stream);
    C10_CUDA_CHECK(static_cast<cudaError_t>(err));
    if (partials.defined()) sum_of_squares.add_(partials.sum());  // fixed grid: deterministic
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
        for (const at::Tensor& g : other_dtypes) {
          sum_of_squares.add_(at::linalg_vector_norm(g, 2, {}, false, at::kFloat).square());
        }
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
  TORCH_CHECK(trackers.device() == device && trackers.scalar_type() == at::kLong &&
                  trackers.numel() == amp_graph::kNumTrackers && trackers.is_contiguous(),
              "trackers must be a contiguous int64 tensor of ", amp_graph::kNumTrackers,
              " elements on ", device);
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

}  // namespace

TORCH_LIBRARY_IMPL(amp_graph, CUDA, m) {
  m.impl("non_finite_check_and_unscale_", &non_finite_check_and_unscale_cuda);
  m.impl("non_finite_check_", &non_finite_check_cuda);
  m.impl("non_finite_check_unscale_and_norm_", &non_finite_check_unscale_and_norm_cuda);
  m.impl("update_scale_", &update_scale_cuda);
}
