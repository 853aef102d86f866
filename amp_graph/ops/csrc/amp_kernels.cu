// Fused non-finite check / unscale / sum-of-squares over many gradients, and the loss-scale update.
//
// Plain CUDA: no torch headers, C-ABI launchers (amp_kernels.h). Index math lives in tiling.h,
// which the host self-test runs on CPU-only CI machines. Nothing here reads host memory per call
// except kernel parameters, so every launch can be captured in a CUDA graph. Never compile with --use_fast_math:
// the finiteness test reads exponent bits, but the unscale must round like torch's.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string.h>

#include "amp_kernels.h"
#include "table_cache.h"
#include "tiling.h"

// Tuning knobs (see tiling.h): blocks per multiprocessor asked of the register allocator (0: none)
// and streaming cache hints on the body's loads and stores (1: __ldcs/__stcs) or plain ones (0).
// Plain: on an H200, 0.90-0.93x memcpy's bandwidth against 0.85-0.88x with the hints, in two
// runs of benchmarks/kernel_sweep.py (BENCHMARKS.md, "GPU").
#ifndef AMP_GRAPH_MIN_BLOCKS
#define AMP_GRAPH_MIN_BLOCKS 0
#endif
#ifndef AMP_GRAPH_STREAMING
#define AMP_GRAPH_STREAMING 0
#endif

namespace amp_graph {
namespace {

__device__ __forceinline__ uint4 load_body(const uint4* p) {
#if AMP_GRAPH_STREAMING
  return __ldcs(p);
#else
  return *p;
#endif
}

__device__ __forceinline__ void store_body(uint4* p, uint4 v) {
#if AMP_GRAPH_STREAMING
  __stcs(p, v);
#else
  *p = v;
#endif
}

static_assert(sizeof(TensorDesc) == 3 * sizeof(int64_t), "table rows are three int64");

// Element traits: raw bits <-> float, finiteness straight from the bits.
template <int Dtype>
struct Elem;

template <>
struct Elem<AMP_GRAPH_FP32> {
  using Bits = uint32_t;
  __device__ static float to_float(Bits b) { return __uint_as_float(b); }
  __device__ static Bits from_float(float x) { return __float_as_uint(x); }
  __device__ static bool finite(Bits b) { return fp32_bits_finite(b); }
};

template <>
struct Elem<AMP_GRAPH_FP16> {
  using Bits = uint16_t;
  __device__ static float to_float(Bits b) { return __half2float(__ushort_as_half(b)); }
  __device__ static Bits from_float(float x) { return __half_as_ushort(__float2half_rn(x)); }
  __device__ static bool finite(Bits b) { return fp16_bits_finite(b); }
};

template <>
struct Elem<AMP_GRAPH_BF16> {
  using Bits = uint16_t;
  __device__ static float to_float(Bits b) { return __uint_as_float(static_cast<uint32_t>(b) << 16); }
  __device__ static Bits from_float(float x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }
  __device__ static bool finite(Bits b) { return bf16_bits_finite(b); }
};

// One element: note non-finite input, unscale in fp32 and round back like torch's
// _amp_foreach_non_finite_check_and_unscale_, accumulate the square of the stored value.
template <int Dtype, int Mode>
__device__ __forceinline__ typename Elem<Dtype>::Bits process(typename Elem<Dtype>::Bits b,
                                                              float inv_scale, bool& bad,
                                                              float& sumsq) {
  using E = Elem<Dtype>;
  bad = bad || !E::finite(b);
  if (Mode == AMP_GRAPH_CHECK) return b;
  const typename E::Bits out = E::from_float(E::to_float(b) * inv_scale);
  if (Mode == AMP_GRAPH_UNSCALE_NORM) {
    const float y = E::to_float(out);
    sumsq += y * y;
  }
  return out;
}

// Tile `local` of one row, by `threads` threads (the block, or one warp) of which this is `tid`.
template <int Dtype, int Mode>
__device__ __forceinline__ void process_row(const TensorDesc& d, int64_t local, int tid,
                                            int threads, float inv_scale, bool& bad,
                                            float& sumsq) {
  using Bits = typename Elem<Dtype>::Bits;
  constexpr int kLanes = static_cast<int>(kVecBytes / sizeof(Bits));
  union Vec {
    uint4 raw;
    Bits lanes[kLanes];
  };
  const TileWork w = tile_work(d.addr, d.numel, sizeof(Bits), local);
  Bits* elems = reinterpret_cast<Bits*>(d.addr);
  uint4* body = reinterpret_cast<uint4*>(elems + w.body_start);

  // Aligned body: kUnroll 16-byte loads in flight per thread.
  const int64_t iterations = vec_iterations(w, threads);
  for (int64_t it = 0; it < iterations; ++it) {
    Vec v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = vec_index(w, it, u, tid, threads);
      if (i < w.vec_end) v[u].raw = load_body(body + i);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = vec_index(w, it, u, tid, threads);
      if (i < w.vec_end) {
#pragma unroll
        for (int l = 0; l < kLanes; ++l) {
          v[u].lanes[l] = process<Dtype, Mode>(v[u].lanes[l], inv_scale, bad, sumsq);
        }
        if (Mode != AMP_GRAPH_CHECK) store_body(body + i, v[u].raw);
      }
    }
  }

  // Misaligned head (first tile) and short tail (last tile): scalar.
  for (int64_t i = tid; i < w.head_end; i += threads) {
    const Bits out = process<Dtype, Mode>(elems[i], inv_scale, bad, sumsq);
    if (Mode != AMP_GRAPH_CHECK) elems[i] = out;
  }
  for (int64_t i = w.tail_begin + tid; i < w.tail_end; i += threads) {
    const Bits out = process<Dtype, Mode>(elems[i], inv_scale, bad, sumsq);
    if (Mode != AMP_GRAPH_CHECK) elems[i] = out;
  }
}

template <int Dtype, int Mode>
#if AMP_GRAPH_MIN_BLOCKS > 0
#define AMP_GRAPH_BOUNDS __launch_bounds__(kBlockThreads, AMP_GRAPH_MIN_BLOCKS)
#else
#define AMP_GRAPH_BOUNDS __launch_bounds__(kBlockThreads)
#endif

__global__ void AMP_GRAPH_BOUNDS
    check_unscale_kernel(const TensorDesc* __restrict__ table, int64_t n_tensors,
                         int64_t total_tiles, float* found_inf, const float* inv_scale_ptr,
                         float* partials) {
  using Bits = typename Elem<Dtype>::Bits;
  constexpr int64_t kElemBytes = sizeof(Bits);
  // Scale read from device memory: no host round trip, and CUDA-graph friendly.
  const float inv_scale = Mode == AMP_GRAPH_CHECK ? 1.0f : *inv_scale_ptr;
  const int tid = static_cast<int>(threadIdx.x);
  bool bad = false;
  float sumsq = 0.0f;

  const TileSpan span = block_tiles(blockIdx.x, gridDim.x, total_tiles, kContiguousTiles);
  for (int64_t tile = span.begin; tile < span.end; tile += span.stride) {
    const TileRows rows = tile_rows(table, n_tensors, tile);
    if (rows.first == rows.last) {  // a large row's tile, or a lone small row: the whole block
      const TensorDesc d = table[rows.last];
      process_row<Dtype, Mode>(d, tile - d.first_tile, tid, kBlockThreads, inv_scale, bad, sumsq);
      continue;
    }
    // A shared tile: small rows one per warp (a large row after empty ones: the whole block).
    for (int64_t r = rows.first; r <= rows.last; ++r) {
      const TensorDesc d = table[r];
      if (d.numel > 0 && !packable(d.addr, d.numel, kElemBytes)) {
        process_row<Dtype, Mode>(d, 0, tid, kBlockThreads, inv_scale, bad, sumsq);
      }
    }
    const int warp = tid / kWarpThreads;
    const int lane = tid % kWarpThreads;
    for (int64_t r = rows.first + warp; r <= rows.last; r += kWarps) {
      const TensorDesc d = table[r];
      if (packable(d.addr, d.numel, kElemBytes)) {
        process_row<Dtype, Mode>(d, 0, lane, kWarpThreads, inv_scale, bad, sumsq);
      }
    }
  }

  // found_inf: at most one store per block, no atomics (every writer stores 1.0f).
  if (__syncthreads_or(bad) && tid == 0) *found_inf = 1.0f;

  if (Mode == AMP_GRAPH_UNSCALE_NORM) {
    __shared__ float warp_sums[kWarps];
    for (int offset = 16; offset > 0; offset /= 2) {
      sumsq += __shfl_down_sync(0xffffffffu, sumsq, offset);
    }
    if (tid % kWarpThreads == 0) warp_sums[tid / kWarpThreads] = sumsq;
    __syncthreads();
    if (tid < kWarpThreads) {
      float s = tid < kWarps ? warp_sums[tid] : 0.0f;
      for (int offset = 16; offset > 0; offset /= 2) {
        s += __shfl_down_sync(0xffffffffu, s, offset);
      }
      if (tid == 0) partials[blockIdx.x] = s;  // fixed grid: deterministic sum
    }
  }
}

// The table writer: `count` words carried in the kernel's parameters (large kernel parameters,
// up to 32 KB, need CUDA 12.1; older toolkits get 4 KB launches).
#if CUDART_VERSION >= 12010
constexpr int64_t kWriteWords = 4000;
#else
constexpr int64_t kWriteWords = 500;
#endif

struct WordsChunk {
  int64_t count;
  int64_t words[kWriteWords];
};

__global__ void write_table_kernel(int64_t* dst, const __grid_constant__ WordsChunk chunk) {
  for (int64_t i = threadIdx.x; i < chunk.count; i += blockDim.x) dst[i] = chunk.words[i];
}

template <int Dtype>
cudaError_t max_active_blocks_dtype(int mode, int* blocks) {
  switch (mode) {
    case AMP_GRAPH_CHECK:
      return cudaOccupancyMaxActiveBlocksPerMultiprocessor(
          blocks, check_unscale_kernel<Dtype, AMP_GRAPH_CHECK>, kBlockThreads, 0);
    case AMP_GRAPH_UNSCALE:
      return cudaOccupancyMaxActiveBlocksPerMultiprocessor(
          blocks, check_unscale_kernel<Dtype, AMP_GRAPH_UNSCALE>, kBlockThreads, 0);
    case AMP_GRAPH_UNSCALE_NORM:
      return cudaOccupancyMaxActiveBlocksPerMultiprocessor(
          blocks, check_unscale_kernel<Dtype, AMP_GRAPH_UNSCALE_NORM>, kBlockThreads, 0);
    default:
      return cudaErrorInvalidValue;
  }
}

template <int Dtype>
cudaError_t launch_dtype(const TensorDesc* table, int64_t n_tensors, int64_t total_tiles,
                         int mode, float* found_inf, const float* inv_scale, float* partials,
                         int grid, cudaStream_t stream) {
  switch (mode) {
    case AMP_GRAPH_CHECK:
      check_unscale_kernel<Dtype, AMP_GRAPH_CHECK><<<grid, kBlockThreads, 0, stream>>>(
          table, n_tensors, total_tiles, found_inf, inv_scale, partials);
      break;
    case AMP_GRAPH_UNSCALE:
      check_unscale_kernel<Dtype, AMP_GRAPH_UNSCALE><<<grid, kBlockThreads, 0, stream>>>(
          table, n_tensors, total_tiles, found_inf, inv_scale, partials);
      break;
    case AMP_GRAPH_UNSCALE_NORM:
      check_unscale_kernel<Dtype, AMP_GRAPH_UNSCALE_NORM><<<grid, kBlockThreads, 0, stream>>>(
          table, n_tensors, total_tiles, found_inf, inv_scale, partials);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

__global__ void update_scale_kernel(float* scale, int64_t* trackers, const float* found_inf,
                                    ScaleParams params) {
  update_scale(scale, trackers, *found_inf > 0.0f, params);
}

}  // namespace
}  // namespace amp_graph

extern "C" int amp_graph_max_active_blocks(int dtype, int mode, int* blocks_per_sm) {
  switch (dtype) {
    case AMP_GRAPH_FP32:
      return amp_graph::max_active_blocks_dtype<AMP_GRAPH_FP32>(mode, blocks_per_sm);
    case AMP_GRAPH_FP16:
      return amp_graph::max_active_blocks_dtype<AMP_GRAPH_FP16>(mode, blocks_per_sm);
    case AMP_GRAPH_BF16:
      return amp_graph::max_active_blocks_dtype<AMP_GRAPH_BF16>(mode, blocks_per_sm);
    default:
      return cudaErrorInvalidValue;
  }
}

extern "C" int amp_graph_write_table(int64_t* table, const int64_t* words, int64_t count,
                                     cudaStream_t stream) {
  static thread_local amp_graph::WordsChunk chunk;  // 32 KB: not on the stack
  for (const auto& part : amp_graph::write_chunks(count, amp_graph::kWriteWords)) {
    chunk.count = part.second;
    memcpy(chunk.words, words + part.first, sizeof(int64_t) * part.second);
    amp_graph::write_table_kernel<<<1, 256, 0, stream>>>(table + part.first, chunk);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

extern "C" int amp_graph_launch_check_unscale(const int64_t* table, int64_t n_tensors,
                                              int64_t total_tiles, int dtype, int mode,
                                              float* found_inf, const float* inv_scale,
                                              float* partials, int grid, cudaStream_t stream) {
  using amp_graph::TensorDesc;
  if (total_tiles <= 0 || n_tensors <= 0) return cudaSuccess;
  if (grid <= 0) return cudaErrorInvalidValue;
  const TensorDesc* rows = reinterpret_cast<const TensorDesc*>(table);
  switch (dtype) {
    case AMP_GRAPH_FP32:
      return amp_graph::launch_dtype<AMP_GRAPH_FP32>(rows, n_tensors, total_tiles, mode, found_inf,
                                                     inv_scale, partials, grid, stream);
    case AMP_GRAPH_FP16:
      return amp_graph::launch_dtype<AMP_GRAPH_FP16>(rows, n_tensors, total_tiles, mode, found_inf,
                                                     inv_scale, partials, grid, stream);
    case AMP_GRAPH_BF16:
      return amp_graph::launch_dtype<AMP_GRAPH_BF16>(rows, n_tensors, total_tiles, mode, found_inf,
                                                     inv_scale, partials, grid, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

extern "C" int amp_graph_launch_update_scale(float* scale, int64_t* trackers,
                                             const float* found_inf, double growth_factor,
                                             double backoff_factor, int64_t growth_interval,
                                             int64_t hysteresis, double min_scale,
                                             double max_scale, cudaStream_t stream) {
  const amp_graph::ScaleParams params = {growth_factor, backoff_factor, growth_interval,
                                         hysteresis,    min_scale,      max_scale};
  amp_graph::update_scale_kernel<<<1, 1, 0, stream>>>(scale, trackers, found_inf, params);
  return cudaGetLastError();
}
