// Python's way into the gradient ops without converting the gradient list per call.
//
// torch.ops.amp_graph.<op>(grads, ...) boxes its arguments: every tensor of the list becomes an
// IValue, and back, on each call. With thousands of small gradients that costs more than the
// kernel (and more than torch's own foreach op, whose binding passes the list unboxed). These
// functions borrow the list's tensors straight from the Python objects (no reference counting)
// and make the same dispatcher call unboxed, as torch's generated bindings do: dispatch keys,
// autograd, profiling and tracing are the dispatcher's, unchanged.
//
// They decline (return False, or None for the norm) before doing anything when Python would see
// more than the dispatcher does: an argument that is not exactly a torch.Tensor (or Parameter),
// or a torch function mode. The caller (scaler_ops.py) then calls torch.ops as before.
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include <vector>

#include "list_ops.h"

namespace {

// Tensors borrowed from a Python list or tuple of exact tensors, released (never decref'd) on
// destruction. Valid while the caller holds the GIL and the sequence.
class BorrowedTensors {
 public:
  BorrowedTensors() = default;
  BorrowedTensors(const BorrowedTensors&) = delete;
  BorrowedTensors& operator=(const BorrowedTensors&) = delete;
  ~BorrowedTensors() {
    for (at::Tensor& t : tensors_) c10::MaybeOwnedTraits<at::Tensor>::destroyBorrow(t);
  }

  // False (nothing borrowed that stays) unless `seq` is a list or tuple of exact tensors.
  bool borrow(PyObject* seq) {
    const bool list = PyList_CheckExact(seq);
    if (!list && !PyTuple_CheckExact(seq)) return false;
    const Py_ssize_t n = list ? PyList_GET_SIZE(seq) : PyTuple_GET_SIZE(seq);
    tensors_.reserve(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* item = list ? PyList_GET_ITEM(seq, i) : PyTuple_GET_ITEM(seq, i);
      if (!THPVariable_CheckExact(item)) return false;
      tensors_.push_back(c10::MaybeOwnedTraits<at::Tensor>::createBorrow(THPVariable_Unpack(item)));
    }
    return true;
  }

  at::TensorList list() const { return tensors_; }

 private:
  std::vector<at::Tensor> tensors_;
};

// Whether every object is exactly a torch.Tensor (or Parameter).
bool exact_tensors(std::initializer_list<PyObject*> objects) {
  for (PyObject* o : objects) {
    if (!THPVariable_CheckExact(o)) return false;
  }
  return true;
}

// Borrows `grads` into `borrowed` when the unboxed call may stand for torch.ops' (see the top of
// this file): no torch function mode, and exact tensors for the list and the flags.
bool may_call_unboxed(BorrowedTensors& borrowed, py::handle grads,
                      std::initializer_list<PyObject*> flags) {
  return !at::impl::torch_function_mode_enabled() && exact_tensors(flags) &&
         borrowed.borrow(grads.ptr());
}

bool check_and_unscale(py::handle grads, py::handle found_inf, py::handle inv_scale) {
  BorrowedTensors borrowed;
  if (!may_call_unboxed(borrowed, grads, {found_inf.ptr(), inv_scale.ptr()})) return false;
  amp_graph::non_finite_check_and_unscale_op().call(
      borrowed.list(), THPVariable_Unpack(found_inf.ptr()), THPVariable_Unpack(inv_scale.ptr()));
  return true;
}

bool check(py::handle grads, py::handle found_inf) {
  BorrowedTensors borrowed;
  if (!may_call_unboxed(borrowed, grads, {found_inf.ptr()})) return false;
  amp_graph::non_finite_check_op().call(borrowed.list(), THPVariable_Unpack(found_inf.ptr()));
  return true;
}

py::object check_unscale_and_norm(py::handle grads, py::handle found_inf, py::handle inv_scale) {
  BorrowedTensors borrowed;
  if (!may_call_unboxed(borrowed, grads, {found_inf.ptr(), inv_scale.ptr()})) return py::none();
  at::Tensor sum_of_squares = amp_graph::non_finite_check_unscale_and_norm_op().call(
      borrowed.list(), THPVariable_Unpack(found_inf.ptr()), THPVariable_Unpack(inv_scale.ptr()));
  return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(sum_of_squares)));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "amp_graph's unboxed entry into its gradient ops (see python_entry.cpp)";
  m.def("check_and_unscale", torch::wrap_pybind_function(check_and_unscale));
  m.def("check", torch::wrap_pybind_function(check));
  m.def("check_unscale_and_norm", torch::wrap_pybind_function(check_unscale_and_norm));
}
