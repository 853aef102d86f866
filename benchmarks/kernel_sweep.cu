// Harness of benchmarks/kernel_sweep.py: the library's check+unscale kernel (amp_kernels.cu,
// compiled beside this file with the tuning knobs of tiling.h / amp_kernels.cu set by -D), timed
// against cudaMemcpyAsync of the same bytes (what torch's copy_ runs for a dense same-dtype copy),
// with no torch in the process.
//
// Cases: one tensor of 1e8 elements in fp32, fp16 and bf16; GPT-2 small's 148 parameter shapes
// in fp32 and fp16. Each tensor starts on a 512-byte boundary of one buffer, as torch's caching
// allocator places them. Prints one JSON object per case: median ms of the kernel (unscale by 1.0)
// and of the copy over interleaved rounds, and whether an unscale by 0.5 gave exactly x / 2 for
// every element (and left found_inf at 0).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "amp_kernels.h"
#include "tiling.h"

namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(err));
    std::exit(1);
  }
}

// Finite values in [-10, 10], from the element index alone.
__global__ void fill(void* data, int64_t n, int dtype) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u;
    h ^= h >> 13;
    const float x = static_cast<float>(static_cast<int>(h % 2001u) - 1000) * 0.01f;
    if (dtype == AMP_GRAPH_FP32) static_cast<float*>(data)[i] = x;
    if (dtype == AMP_GRAPH_FP16) static_cast<__half*>(data)[i] = __float2half_rn(x);
    if (dtype == AMP_GRAPH_BF16) static_cast<__nv_bfloat16*>(data)[i] = __float2bfloat16_rn(x);
  }
}

float to_float(const uint8_t* p, int dtype) {
  if (dtype == AMP_GRAPH_FP32) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  if (dtype == AMP_GRAPH_FP16) {
    __half_raw raw;
    raw.x = bits;
    return __half2float(__half(raw));
  }
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, 4);
  return f;
}

std::vector<int64_t> gpt2_small_numels() {
  const int64_t d = 768, vocab = 50257, context = 1024;
  std::vector<int64_t> n = {vocab * d, context * d};
  for (int layer = 0; layer < 12; ++layer) {
    for (int64_t k : {d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d}) {
      n.push_back(k);
    }
  }
  n.push_back(d);
  n.push_back(d);
  return n;
}

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void run_case(const char* name, const std::vector<int64_t>& numels, int dtype, int reps) {
  const int64_t elem = dtype == AMP_GRAPH_FP32 ? 4 : 2;
  std::vector<amp_graph::TensorDesc> rows;
  int64_t offset = 0;
  for (int64_t n : numels) {
    rows.push_back({offset, n, 0});
    offset += (n * elem + 511) / 512 * 512;
  }
  const int64_t bytes = offset;
  uint8_t* data = nullptr;
  uint8_t* copy_src = nullptr;
  uint8_t* copy_dst = nullptr;
  check(cudaMalloc(&data, bytes), "cudaMalloc");
  int64_t payload = 0;
  for (auto& r : rows) {
    fill<<<1024, 256>>>(data + r.addr, r.numel, dtype);
    r.addr += reinterpret_cast<int64_t>(data);
    payload += r.numel * elem;
  }
  check(cudaMalloc(&copy_src, payload), "cudaMalloc");
  check(cudaMalloc(&copy_dst, payload), "cudaMalloc");
  const int64_t total_tiles =
      amp_graph::build_tile_table(rows.data(), static_cast<int64_t>(rows.size()), elem);
  int64_t* table = nullptr;
  check(cudaMalloc(&table, rows.size() * sizeof(amp_graph::TensorDesc)), "cudaMalloc");
  check(cudaMemcpy(table, rows.data(), rows.size() * sizeof(amp_graph::TensorDesc),
                   cudaMemcpyHostToDevice),
        "table");
  int sms = 0;
  int blocks = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "sms");
  check(static_cast<cudaError_t>(amp_graph_max_active_blocks(dtype, AMP_GRAPH_UNSCALE, &blocks)),
        "occupancy");
  const int grid = static_cast<int>(amp_graph::grid_size(total_tiles, int64_t(sms) * blocks));
  float* flags = nullptr;  // found_inf, inv_scale 1.0, inv_scale 0.5
  check(cudaMalloc(&flags, 3 * sizeof(float)), "cudaMalloc");
  const float init[3] = {0.0f, 1.0f, 0.5f};
  check(cudaMemcpy(flags, init, sizeof(init), cudaMemcpyHostToDevice), "flags");

  auto unscale = [&](const float* inv) {
    check(static_cast<cudaError_t>(amp_graph_launch_check_unscale(
              table, static_cast<int64_t>(rows.size()), total_tiles, dtype, AMP_GRAPH_UNSCALE,
              flags, inv, nullptr, grid, nullptr)),
          "launch");
  };
  auto copy = [&] {
    check(cudaMemcpyAsync(copy_dst, copy_src, payload, cudaMemcpyDeviceToDevice, nullptr),
          "copy");
  };
  cudaEvent_t start, end;
  check(cudaEventCreate(&start), "event");
  check(cudaEventCreate(&end), "event");
  auto time_ms = [&](auto fn) {
    check(cudaEventRecord(start), "record");
    fn();
    check(cudaEventRecord(end), "record");
    check(cudaEventSynchronize(end), "sync");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start, end), "elapsed");
    return ms;
  };
  for (int i = 0; i < 3; ++i) {
    unscale(flags + 1);
    copy();
  }
  std::vector<float> ours, copies;
  for (int i = 0; i < reps; ++i) {
    ours.push_back(time_ms([&] { unscale(flags + 1); }));
    copies.push_back(time_ms(copy));
  }

  // Exactness: an unscale by 0.5 halves every (normal) value exactly.
  std::vector<uint8_t> before(bytes), after(bytes);
  check(cudaMemcpy(before.data(), data, bytes, cudaMemcpyDeviceToHost), "before");
  unscale(flags + 2);
  check(cudaMemcpy(after.data(), data, bytes, cudaMemcpyDeviceToHost), "after");
  float found = 1.0f;
  check(cudaMemcpy(&found, flags, sizeof(float), cudaMemcpyDeviceToHost), "found");
  bool exact = found == 0.0f;
  for (const auto& r : rows) {
    const int64_t base = r.addr - reinterpret_cast<int64_t>(data);
    for (int64_t i = 0; exact && i < r.numel; ++i) {
      const float x = to_float(before.data() + base + i * elem, dtype);
      exact = to_float(after.data() + base + i * elem, dtype) == x * 0.5f;
    }
  }
  const char* dtype_name = dtype == AMP_GRAPH_FP32 ? "fp32" : (dtype == AMP_GRAPH_FP16 ? "fp16"
                                                                                       : "bf16");
  const float ms = median(ours), copy_ms = median(copies);
  std::printf(
      "{\"case\": \"%s\", \"dtype\": \"%s\", \"tensors\": %zu, \"mbytes\": %.1f, \"ms\": %.4f, "
      "\"copy_ms\": %.4f, \"gbps\": %.1f, \"copy_gbps\": %.1f, \"grid\": %d, "
      "\"blocks_per_sm\": %d, \"tiles\": %lld, \"exact\": %s}\n",
      name, dtype_name, rows.size(), payload / 1e6, ms, copy_ms, 2.0 * payload / ms / 1e6,
      2.0 * payload / copy_ms / 1e6, grid, blocks, static_cast<long long>(total_tiles),
      exact ? "true" : "false");
  std::fflush(stdout);
  cudaFree(data);
  cudaFree(copy_src);
  cudaFree(copy_dst);
  cudaFree(table);
  cudaFree(flags);
  cudaEventDestroy(start);
  cudaEventDestroy(end);
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 30;
  const std::vector<int64_t> big = {100000000};
  run_case("1x1e8", big, AMP_GRAPH_FP32, reps);
  run_case("1x1e8", big, AMP_GRAPH_FP16, reps);
  run_case("1x1e8", big, AMP_GRAPH_BF16, reps);
  run_case("gpt2_mix", gpt2_small_numels(), AMP_GRAPH_FP32, reps);
  run_case("gpt2_mix", gpt2_small_numels(), AMP_GRAPH_FP16, reps);
  return 0;
}
