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
#include <cstring>
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
  } else if constexpr (std::is_same_v<scalar_t, c10::Half>) {
    // float16's fields moved into a float's: exact, and branch-free (c10's conversion is a
    // call per element that does not vectorize); subnormals by subtracting 2^-14's offset
    const uint16_t* raw = reinterpret_cast<const uint16_t*>(x);
    constexpr uint32_t kExponent = 0x7c00u << 13;
    const float subnormal_offset = std::bit_cast<float>(113u << 23);
    for (int64_t j = 0; j < n; ++j) {
      const uint32_t shifted = static_cast<uint32_t>(raw[j] & 0x7fff) << 13;
      const uint32_t exponent = shifted & kExponent;
      const uint32_t normal = shifted + ((127u - 15u) << 23);
      const uint32_t special = normal + ((128u - 16u) << 23);  // inf, NaN
      const uint32_t subnormal =
          std::bit_cast<uint32_t>(std::bit_cast<float>(normal + (1u << 23)) - subnormal_offset);
      // selects by masks: a ternary here kept the loop scalar
      const uint32_t is_special = 0u - static_cast<uint32_t>(exponent == kExponent);
      const uint32_t is_subnormal = 0u - static_cast<uint32_t>(exponent == 0);
      const uint32_t bits = (special & is_special) | (subnormal & is_subnormal) |
                            (normal & ~(is_special | is_subnormal));
      m[j] = std::bit_cast<float>(bits);
    }
  } else {
    for (int64_t j = 0; j < n; ++j) m[j] = std::abs(static_cast<acc_t>(x[j]));
  }
}

// 32 bytes of acc_t, and the comparison masks of as many lanes
template <typename acc_t>
struct Lanes;
template <>
struct Lanes<float> {
  typedef float Vector __attribute__((vector_size(32)));
  typedef int32_t Mask __attribute__((vector_size(32)));
  static constexpr int kWidth = 8;
};
template <>
struct Lanes<double> {
  typedef double Vector __attribute__((vector_size(32)));
  typedef int64_t Mask __attribute__((vector_size(32)));
  static constexpr int kWidth = 4;
};

// acc_t: float for every floating dtype but double (whose values float would round).
// A block at a time: magnitudes into a buffer, then one pass of simple loops with integer
// counters that the compiler vectorizes: per lane, the largest finite magnitude, the extremes
// of the scaled magnitudes of the nonzero values, the zeros and the non-finite values. Each
// threshold count then needs a pass over the block only where the threshold falls inside
// the block's range: below the range it counts nothing, above it every nonzero finite value
// (gradients, mostly below e4m3's zero, took eight more passes before).
template <typename scalar_t, typename acc_t>
Counts count_range(const scalar_t* data, int64_t begin, int64_t end, acc_t scale,
                   acc_t run_threshold, const std::array<acc_t, kFormats>& zero_at,
                   const std::array<acc_t, kFormats>& max_of) {
  constexpr acc_t kLargest = std::numeric_limits<acc_t>::max();
  constexpr acc_t kInf = std::numeric_limits<acc_t>::infinity();
  constexpr int64_t kBlock = 256;
  using V = typename Lanes<acc_t>::Vector;
  const V zero_v = {}, largest_v = zero_v + kLargest, inf_v = zero_v + kInf;
  Counts c;
  V lane_max = zero_v;
  alignas(64) acc_t m[kBlock];
  alignas(64) acc_t s_buffer[kBlock];
  const bool scaled = scale != acc_t(1);
  const acc_t* s = scaled ? s_buffer : m;  // the scaled magnitudes (scale 1: themselves)
  // The range argument needs s to be +inf where m is, and never NaN: a positive finite scale.
  // Any other scale counts every threshold with a pass, as the definitions read.
  const bool by_range = scale > acc_t(0) && scale <= kLargest;
  for (int64_t start = begin; start < end; start += kBlock) {
    const int64_t n = std::min(kBlock, end - start);
    magnitudes(data + start, m, n);
    for (int64_t j = n; j < kBlock; ++j) m[j] = 0;  // padding: zeros, taken back below
    if (scaled) {
      for (int64_t j = 0; j < kBlock; ++j) s_buffer[j] = m[j] * scale;
    }
    // one pass in vectors (GCC/Clang vector extensions: one maximum, minimum or count per
    // lane, no reordered float reduction); inf and NaN are not finite (NaN compares false)
    using M = typename Lanes<acc_t>::Mask;
    V s_low = inf_v, s_high = zero_v;
    M zero_lanes = {}, nonfinite_lanes = {};
    for (int64_t j = 0; j < kBlock; j += Lanes<acc_t>::kWidth) {
      V mv, sv;
      std::memcpy(&mv, m + j, sizeof(V));
      std::memcpy(&sv, s + j, sizeof(V));
      const M finite = mv <= largest_v;
      const V finite_m = finite ? mv : zero_v;
      lane_max = lane_max > finite_m ? lane_max : finite_m;
      const V high = finite_m > zero_v ? sv : zero_v;  // of nonzero finite values
      s_high = s_high > high ? s_high : high;
      const V low = mv > zero_v ? sv : inf_v;  // of nonzero values
      s_low = s_low < low ? s_low : low;
      zero_lanes -= mv == zero_v;  // a true comparison is -1
      nonfinite_lanes -= ~finite;
    }
    int64_t zeros = -(kBlock - n), nonfinite = 0;
    acc_t lowest = kInf, highest = 0;
    for (int k = 0; k < Lanes<acc_t>::kWidth; ++k) {
      zeros += zero_lanes[k];
      nonfinite += nonfinite_lanes[k];
      lowest = std::min(lowest, s_low[k]);
      highest = std::max(highest, s_high[k]);
    }
    c.zeros += zeros;
    c.nonfinite += nonfinite;
    const int64_t nonzero_finite = n - zeros - nonfinite;
    // how many nonzero values have s <= threshold (at_most) or s < threshold (!at_most)
    const auto below = [&](acc_t threshold, bool at_most) -> int64_t {
      if (by_range) {
        if (at_most ? lowest > threshold : lowest >= threshold) return 0;
        if (at_most ? highest <= threshold : highest < threshold) return nonzero_finite;
      }
      int32_t count = 0;
      if (at_most) {
        for (int64_t j = 0; j < n; ++j) count += (m[j] > 0) & (s[j] <= threshold);
      } else {
        for (int64_t j = 0; j < n; ++j) count += (m[j] > 0) & (s[j] < threshold);
      }
      return count;
    };
    c.underflow += below(run_threshold, false);
    for (int f = 0; f < kFormats; ++f) {
      c.under[f] += below(zero_at[f], true);
      // finite values whose s exceeds the format's largest
      if (by_range && highest <= max_of[f]) continue;
      int32_t over = 0;
      const acc_t largest = max_of[f];
      for (int64_t j = 0; j < n; ++j) over += (m[j] <= kLargest) & (s[j] > largest);
      c.over[f] += over;
    }
  }
  acc_t amax = 0;
  for (int k = 0; k < Lanes<acc_t>::kWidth; ++k) amax = std::max(amax, lane_max[k]);
  c.amax = static_cast<double>(amax);
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
