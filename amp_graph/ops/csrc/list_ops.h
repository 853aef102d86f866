// Typed dispatcher handles of the three gradient-list ops, for the unboxed calls that both
// binding.cpp (the AutogradCUDA kernels' redispatch) and python_entry.cpp (the call from Python)
// make. Each is looked up once, at its first use: the schemas are defined by
// amp_graph/ops/scaler_ops.py, which is imported before the extension loads.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

namespace amp_graph {

using UnscaleOp = c10::TypedOperatorHandle<void(at::TensorList, const at::Tensor&,
                                                const at::Tensor&)>;
using CheckOp = c10::TypedOperatorHandle<void(at::TensorList, const at::Tensor&)>;
using NormOp = c10::TypedOperatorHandle<at::Tensor(at::TensorList, const at::Tensor&,
                                                   const at::Tensor&)>;

inline const UnscaleOp& non_finite_check_and_unscale_op() {
  static const UnscaleOp op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("amp_graph::non_finite_check_and_unscale_", "")
          .typed<void(at::TensorList, const at::Tensor&, const at::Tensor&)>();
  return op;
}

inline const CheckOp& non_finite_check_op() {
  static const CheckOp op = c10::Dispatcher::singleton()
                                .findSchemaOrThrow("amp_graph::non_finite_check_", "")
                                .typed<void(at::TensorList, const at::Tensor&)>();
  return op;
}

inline const NormOp& non_finite_check_unscale_and_norm_op() {
  static const NormOp op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("amp_graph::non_finite_check_unscale_and_norm_", "")
          .typed<at::Tensor(at::TensorList, const at::Tensor&, const at::Tensor&)>();
  return op;
}

}  // namespace amp_graph
