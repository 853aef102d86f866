// Grid limits of the fused kernel, asked of the CUDA runtime once per (device, dtype, mode).
//
// How many blocks of a kernel fit on one multiprocessor depends on its registers and shared
// memory, hence on the dtype/mode instantiation and the device; a fixed number overfills some
// GPUs and starves others. The binding asks cudaOccupancyMaxActiveBlocksPerMultiprocessor and
// the multiprocessor count once and keeps the product here. Plain C++ (the host self-test runs it
// with a counting fake).
#pragma once

#include <stdint.h>

#include <map>
#include <mutex>
#include <tuple>

namespace amp_graph {

// Query: an object with int sm_count(int device) and int blocks_per_sm(int device, int dtype,
// int mode); each is called at most once per argument tuple. Thread-safe.
template <class Query>
class LaunchCache {
 public:
  explicit LaunchCache(Query query) : query_(query) {}

  // Blocks of (dtype, mode) that fit on `device` at once: multiprocessors x resident blocks.
  int64_t max_grid(int device, int dtype, int mode) {
    const std::lock_guard<std::mutex> lock(mutex_);
    const auto key = std::make_tuple(device, dtype, mode);
    auto it = grids_.find(key);
    if (it != grids_.end()) return it->second;
    auto sms = sm_counts_.find(device);
    if (sms == sm_counts_.end()) sms = sm_counts_.emplace(device, query_.sm_count(device)).first;
    const int blocks = query_.blocks_per_sm(device, dtype, mode);
    const int64_t grid = static_cast<int64_t>(sms->second) * (blocks > 0 ? blocks : 1);
    grids_.emplace(key, grid);
    return grid;
  }

  Query& query() { return query_; }

 private:
  Query query_;
  std::mutex mutex_;
  std::map<int, int> sm_counts_;
  std::map<std::tuple<int, int, int>, int64_t> grids_;
};

}  // namespace amp_graph
