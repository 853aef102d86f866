// C ABI of the plain-CUDA kernels in amp_kernels.cu. The torch binding (binding.cpp) is the only
// caller; keeping torch out of the .cu file lets a CPU-only CI machine compile it with nvcc.
#pragma once

#include <cuda_runtime_api.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Gradient element types understood by the fused kernel.
enum AmpGraphDtype { AMP_GRAPH_FP32 = 0, AMP_GRAPH_FP16 = 1, AMP_GRAPH_BF16 = 2 };

// What the fused kernel does with each element.
enum AmpGraphMode {
  AMP_GRAPH_CHECK = 0,           // read only: set *found_inf if any element is inf or nan
  AMP_GRAPH_UNSCALE = 1,         // also write element * (*inv_scale)
  AMP_GRAPH_UNSCALE_NORM = 2,    // also add the squares of the written values into partials
};

// One launch over every tensor of `table` (device memory, n_tensors rows of
// amp_graph::TensorDesc, first_tile filled by build_tile_table), all of element type `dtype`.
// found_inf: device float, set to 1.0f (at most one store per block) when a non-finite element is
// seen and never cleared. inv_scale: device float, unused for AMP_GRAPH_CHECK. partials: device
// float[grid], written (one per block) for AMP_GRAPH_UNSCALE_NORM, else may be null.
// Returns the cudaError_t of the launch.
int amp_graph_launch_check_unscale(const int64_t* table, int64_t n_tensors, int64_t total_tiles,
                                   int dtype, int mode, float* found_inf, const float* inv_scale,
                                   float* partials, int grid, cudaStream_t stream);

// Resident blocks per multiprocessor of the (dtype, mode) kernel on the current device
// (cudaOccupancyMaxActiveBlocksPerMultiprocessor). Returns the cudaError_t.
int amp_graph_max_active_blocks(int dtype, int mode, int* blocks_per_sm);

// Writes `count` int64 words from host memory into device memory `table`, on `stream`, with
// kernels that carry the words in their parameters: no host staging buffer to keep alive, so the
// write can be captured in a CUDA graph. Returns the cudaError_t of the last launch.
int amp_graph_write_table(int64_t* table, const int64_t* words, int64_t count,
                          cudaStream_t stream);

// One update of the loss scale on the device (one thread); see amp_graph::update_scale.
// scale: device float; trackers: device int64[4]; found_inf: device float (> 0 means overflow).
int amp_graph_launch_update_scale(float* scale, int64_t* trackers, const float* found_inf,
                                  double growth_factor, double backoff_factor,
                                  int64_t growth_interval, int64_t hysteresis, double min_scale,
                                  double max_scale, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
