// CPU kernel of the monitor's statistics (amp_graph/ops/tensor_stats.py defines each one): one pass
// over a tensor accumulates every statistic into a float64 row, instead of a dozen torch ops
// that each read the tensor and allocate a mask. Built on first use by
// amp_graph/ops/cpu_extension.py; where it is not built, tensor_stats.py computes the same
// numbers with torch ops.
//
// Row layout (tensor_stats.STATS): amax, zeros, underflow, nonfinite, then for fp16, bf16, e4m3,
// e5m2 an underflow and an overflow count, then numel. amax is a maximum, the rest add up.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

namespace {

constexpr int kFormats = 4;
constexpr int kColumns = 4 + 2 * kFormats + 1;

struct Counts {
  double amax = 0.0;
  int64_t zeros = 0, underflow = 0, nonfinite = 0;
  std::array<int64_t, kFormats> under{}, over{};

  void add(const Counts& other) {
    amax = std::max(amax, other.amax);
    zeros += other.zeros;
    underflow += other.underflow;
    nonfinite += other.nonfinite;
    for (int f = 0; f < kFormats; ++f) {
      under[f] += other.under[f];
      over[f] += other.over[f];
    }
  }
};

// |x| as acc_t. bfloat16 is the top half of a float: shifting its bits converts it without
// c10's NaN branch, so that the loop vectorizes.
template <typename scalar_t, typename acc_t>
void magnitudes(const scalar_t* x, acc_t* m, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    const uint16_t* raw = reinterpret_cast<const uint16_t*>(x);
    for (int64_t j = 0; j < n; ++j) {
      m[j] = std::bit_cast<float>(static_cast<uint32_t>(raw[j] & 0x7fff) << 16);
    }
  } else {
    for (int64_t j = 0; j < n; ++j) m[j] = std::abs(static_cast<acc_t>(x[j]));
  }
}

// acc_t: float for every floating dtype but double (whose values float would round).
// A block at a time: magnitudes into a buffer, then simple loops with integer counters that
// the compiler vectorizes; a block whose values are all in range for every format (most
// blocks of activations and weights) skips the per-format counts.
template <typename scalar_t, typename acc_t>
Counts count_range(const scalar_t* data, int64_t begin, int64_t end, acc_t scale,
                   acc_t run_threshold, const std::array<acc_t, kFormats>& zero_at,
                   const std::array<acc_t, kFormats>& max_of) {
  constexpr acc_t kLargest = std::numeric_limits<acc_t>::max();
  constexpr int64_t kBlock = 256;
  // in range everywhere: not below any zero threshold or the run dtype's normal range, and
  // not above any format's largest value
  acc_t low = run_threshold, high = kLargest;
  for (int f = 0; f < kFormats; ++f) {
    low = std::max(low, std::nextafter(zero_at[f], kLargest));
    high = std::min(high, max_of[f]);
  }
  constexpr int kLanes = 8;
  Counts c;
  acc_t lane_max[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  acc_t m[kBlock], s_buffer[kBlock];
  const bool scaled = scale != acc_t(1);
  const acc_t* s = scaled ? s_buffer : m;  // the scaled magnitudes (scale 1: themselves)
  for (int64_t start = begin; start < end; start += kBlock) {
    const int64_t n = std::min(kBlock, end - start);
    const scalar_t* block = data + start;
    magnitudes(block, m, n);
    if (scaled) {
      for (int64_t j = 0; j < n; ++j) s_buffer[j] = m[j] * scale;
    }
    // the largest finite magnitude, one maximum per lane (so the loop vectorizes without
    // reordering a float reduction); inf and NaN count as 0
    for (int64_t j = n; j < kBlock; ++j) m[j] = 0;
    for (int64_t j = 0; j < kBlock; j += kLanes) {
      for (int k = 0; k < kLanes; ++k) {
        const acc_t v = m[j + k] <= kLargest ? m[j + k] : acc_t(0);
        lane_max[k] = lane_max[k] > v ? lane_max[k] : v;
      }
    }
    // a zero is in range for every format (ReLU's outputs are half zeros): counted here
    int32_t zeros = 0, inside = 0;  // NaN compares false: outside
    for (int64_t j = 0; j < n; ++j) zeros += m[j] == 0;
    for (int64_t j = 0; j < n; ++j) inside += ((s[j] >= low) & (s[j] <= high)) | (m[j] == 0);
    c.zeros += zeros;
    if (inside == n) continue;
    int32_t underflow = 0, nonfinite = 0;
    for (int64_t j = 0; j < n; ++j) nonfinite += !(m[j] <= kLargest);  // inf, NaN
    for (int64_t j = 0; j < n; ++j) underflow += (m[j] > 0) & (s[j] < run_threshold);
    c.underflow += underflow;
    c.nonfinite += nonfinite;
    for (int f = 0; f < kFormats; ++f) {
      int32_t under = 0, over = 0;
      const acc_t zero = zero_at[f], largest = max_of[f];
      for (int64_t j = 0; j < n; ++j) under += (m[j] > 0) & (s[j] <= zero);
      for (int64_t j = 0; j < n; ++j) over += (m[j] <= kLargest) & (s[j] > largest);
      c.under[f] += under;
      c.over[f] += over;
    }
  }
  c.amax = static_cast<double>(*std::max_element(lane_max, lane_max + kLanes));
  return c;
}

template <typename scalar_t>
Counts count_all(const at::Tensor& x, double scale, double run_threshold,
                 at::ArrayRef<double> zero_at, at::ArrayRef<double> max_of) {
  using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
  std::array<acc_t, kFormats> zero{}, largest{};
  for (int f = 0; f < kFormats; ++f) {
    zero[f] = static_cast<acc_t>(zero_at[f]);
    largest[f] = static_cast<acc_t>(max_of[f]);
  }
  const scalar_t* data = x.const_data_ptr<scalar_t>();
  const int64_t n = x.numel();
  constexpr int64_t kGrain = 1 << 15;
  const int64_t chunks = std::max<int64_t>(1, (n + kGrain - 1) / kGrain);
  std::vector<Counts> partial(chunks);
  at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
    for (int64_t k = first; k < last; ++k) {
      partial[k] = count_range<scalar_t, acc_t>(data, k * kGrain, std::min(n, (k + 1) * kGrain),
                                                static_cast<acc_t>(scale),
                                                static_cast<acc_t>(run_threshold), zero, largest);
    }
  });
  Counts total;
  for (const Counts& c : partial) total.add(c);
  return total;
}

// Adds x's statistics into row (float64, kColumns contiguous values).
void tensor_stats_(const at::Tensor& x, at::Tensor& row, double scale, double run_threshold, at::ArrayRef<double> zero_at,
                   at::ArrayRef<double> max_of) {
  TORCH_CHECK(x.device().is_cpu() && row.device().is_cpu(), "tensor_stats_ is the CPU kernel");
  TORCH_CHECK(row.scalar_type() == at::kDouble && row.is_contiguous() && row.numel() == kColumns,
              "tensor_stats_: row is ", kColumns, " contiguous float64 values");
  TORCH_CHECK(zero_at.size() == kFormats && max_of.size() == kFormats,
              "tensor_stats_: one zero threshold and one largest value per format");
  const at::Tensor values = x.contiguous();
  Counts c;
  AT_DISPATCH_SWITCH(
      values.scalar_type(), "tensor_stats_",
      AT_DISPATCH_CASE_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, [&] {
        c = count_all<scalar_t>(values, scale, run_threshold, zero_at, max_of);
      })
      AT_DISPATCH_CASE(at::kFloat8_e4m3fn, [&] {
        c = count_all<scalar_t>(values, scale, run_threshold, zero_at, max_of);
      })
      AT_DISPATCH_CASE(at::kFloat8_e5m2, [&] {
        c = count_all<scalar_t>(values, scale, run_threshold, zero_at, max_of);
      }));
  double* out = row.data_ptr<double>();
  out[0] = std::max(out[0], c.amax);
  out[1] += static_cast<double>(c.zeros);
  out[2] += static_cast<double>(c.underflow);
  out[3] += static_cast<double>(c.nonfinite);
  for (int f = 0; f < kFormats; ++f) {
    out[4 + 2 * f] += static_cast<double>(c.under[f]);
    out[5 + 2 * f] += static_cast<double>(c.over[f]);
  }
  out[kColumns - 1] += static_cast<double>(values.numel());
}

// scale: None, or one value (a tensorwise fp8 scale); read here, on the host it lives on
void tensor_stats_op(const at::Tensor& x, at::Tensor row, const std::optional<at::Tensor>& scale,
                     double run_threshold, at::ArrayRef<double> zero_at,
                     at::ArrayRef<double> max_of) {
  const bool scaled = scale.has_value();
  if (scaled) {
    TORCH_CHECK(scale->numel() == 1 && scale->device().is_cpu(),
                "tensor_stats_: the CPU kernel takes one scale on the CPU");
  }
  const double value = scaled ? scale->to(at::kDouble).item<double>() : 1.0;
  tensor_stats_(x, row, value, run_threshold, zero_at, max_of);
}

}  // namespace

TORCH_LIBRARY(amp_graph_cpu, m) {
  m.def(
      "tensor_stats_(Tensor x, Tensor(a!) row, Tensor? scale, float run_threshold, "
      "float[] zero_at, float[] max_of) -> ()");
}

TORCH_LIBRARY_IMPL(amp_graph_cpu, CPU, m) { m.impl("tensor_stats_", &tensor_stats_op); }
