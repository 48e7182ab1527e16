// Gradient intake in C++, as DDP's reducer takes gradients: a post hook on each parameter's
// AccumulateGrad node (torch::autograd::Node::add_post_hook). Per bucket, the Python side
// (sapipe/runtime/intake.py, sapipe/runtime/pipeline.py) is called twice an iteration: as the
// bucket's first gradient arrives (`on_first`: apply what still reads the slot, then hand over
// where each gradient goes, or None to take this bucket's gradients in Python this iteration)
// and once the bucket is complete (`on_complete`: launch it). Between the two, each gradient is
// copied into its places here, with no Python call, unless autograd accumulated it there
// already (p.grad left as the exposed view of the slot: `same_view`). A parameter outside every bucket, a
// bucket Python takes itself, or a second gradient of a parameter goes to `on_slow(param)`.
//
// The hooks run on the autograd engine's thread for the parameters' device, one gradient at a
// time (a model's parameters share one device), and call Python only with the GIL taken.
#include "gradient_intake.h"

#include "check.h"

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/node.h>
#include <torch/csrc/autograd/variable.h>

#include <memory>
#include <utility>
#include <vector>

namespace sapipe {
namespace {
namespace py = pybind11;
using torch::autograd::Node;
using torch::autograd::variable_list;

enum class Route : char { kUndecided, kHere, kPython };

struct BucketIntake {
  int64_t size = 0;
  std::vector<char> ready;  // per parameter of the bucket: its gradient of this iteration arrived
  int64_t num_ready = 0;
  Route route = Route::kUndecided;
  std::vector<std::vector<at::Tensor>> targets;  // per target, each parameter's view there
};

// Whether `grad` is `view` itself: p.grad was left as the exposed view of this slot
// (zero_grad(set_to_none=False); a stale bucket's view is of the slot the next iteration
// fills) and autograd accumulated into it in place, as into DDP's gradient_as_bucket_view.
inline bool same_view(const at::Tensor& view, const at::Tensor& grad) {
  return view.data_ptr() == grad.data_ptr() && view.dtype() == grad.dtype() &&
         view.sizes() == grad.sizes() && view.strides() == grad.strides();
}

struct IntakeState {
  std::vector<at::Tensor> params;
  std::vector<int64_t> bucket_of;  // per parameter: its bucket (-1: none), and place there
  std::vector<int64_t> position;
  std::vector<BucketIntake> buckets;
  py::object on_slow, on_first, on_complete;
  bool paused = false;  // inside no_sync(): gradients only accumulate in p.grad
  // the AccumulateGrad nodes (kept alive, as DDP's reducer keeps them) and each hook's key
  std::vector<std::pair<c10::intrusive_ptr<Node>, uintptr_t>> hooks;

  // A Python call from the engine's thread, the GIL held: its exception travels to
  // backward()'s caller as torch's own hooks' do.
  template <typename... Args>
  static py::object invoke(const py::object& fn, Args&&... args) {
    try {
      return fn(std::forward<Args>(args)...);
    } catch (py::error_already_set& e) {
      e.restore();
      python_error error;
      error.persist();
      throw error;
    }
  }

  void call(const py::object& fn, const at::Tensor& param) {
    py::gil_scoped_acquire gil;
    invoke(fn, param);  // the result is dropped with the GIL held
  }

  void call(const py::object& fn, int64_t bucket) {
    py::gil_scoped_acquire gil;
    invoke(fn, bucket);
  }

  void take(size_t j) {
    if (paused) return;
    const int64_t b = bucket_of[j];
    const at::Tensor& param = params[j];
    if (b < 0) {
      call(on_slow, param);
      return;
    }
    BucketIntake& bucket = buckets[b];
    if (bucket.route == Route::kUndecided) {
      py::gil_scoped_acquire gil;
      py::object targets = invoke(on_first, b);
      if (targets.is_none()) {
        bucket.route = Route::kPython;
      } else {
        bucket.targets = targets.cast<std::vector<std::vector<at::Tensor>>>();
        bucket.route = Route::kHere;
      }
    }
    const int64_t i = position[j];
    const at::Tensor& grad = param.grad();
    if (bucket.route == Route::kPython || bucket.ready[i] || !grad.defined()) {
      call(on_slow, param);  // Python's path, and its errors
      return;
    }
    {
      at::NoGradGuard no_grad;  // backward(create_graph=True) records none of this
      for (auto& views : bucket.targets)
        if (!same_view(views[i], grad)) views[i].copy_(grad);
    }
    bucket.ready[i] = 1;
    if (++bucket.num_ready == bucket.size) call(on_complete, b);
  }

  // Unhook, and drop the Python callbacks (they refer back to the intake's owner): with the
  // GIL held, from Python.
  void remove() {
    for (auto& [node, key] : hooks) node->del_post_hook(key);
    hooks.clear();
    on_slow = on_first = on_complete = py::none();
  }
};

struct IntakeHook : torch::autograd::FunctionPostHook {
  IntakeHook(std::weak_ptr<IntakeState> state, size_t index)
      : state(std::move(state)), index(index) {}

  variable_list operator()(const variable_list& outputs, const variable_list& /*inputs*/) override {
    if (auto alive = state.lock()) alive->take(index);
    return outputs;
  }

  std::weak_ptr<IntakeState> state;
  size_t index;
};

class GradientIntake {
 public:
  GradientIntake(std::vector<at::Tensor> params, py::object on_slow, py::object on_first,
                 py::object on_complete)
      : state_(std::make_shared<IntakeState>()) {
    IntakeState& s = *state_;
    s.on_slow = std::move(on_slow);
    s.on_first = std::move(on_first);
    s.on_complete = std::move(on_complete);
    s.bucket_of.assign(params.size(), -1);
    s.position.assign(params.size(), 0);
    for (size_t j = 0; j < params.size(); ++j) {
      SAPIPE_CHECK(params[j].requires_grad() && params[j].is_leaf(),
                  "sapipe: the gradient intake hooks trainable leaf tensors only");
      auto node = torch::autograd::impl::grad_accumulator(params[j]);
      auto key = node->add_post_hook(std::make_unique<IntakeHook>(state_, j));
      s.hooks.emplace_back(std::move(node), key);
    }
    s.params = std::move(params);
  }

  ~GradientIntake() { state_->remove(); }

  void lay_out(const std::vector<int64_t>& bucket_of, const std::vector<int64_t>& position,
               const std::vector<int64_t>& sizes) {
    IntakeState& s = *state_;
    SAPIPE_CHECK(bucket_of.size() == s.params.size() && position.size() == s.params.size(),
                "sapipe: a layout names every parameter");
    s.bucket_of = bucket_of;
    s.position = position;
    s.buckets.assign(sizes.size(), BucketIntake{});
    for (size_t b = 0; b < sizes.size(); ++b) {
      s.buckets[b].size = sizes[b];
      s.buckets[b].ready.assign(sizes[b], 0);
    }
  }

  BucketIntake& bucket(int64_t b) {
    SAPIPE_CHECK(b >= 0 && b < static_cast<int64_t>(state_->buckets.size()),
                "sapipe: no bucket ", b);
    return state_->buckets[b];
  }

  int64_t num_ready(int64_t b) { return bucket(b).num_ready; }

  bool is_ready(int64_t b, int64_t i) { return bucket(b).ready.at(i); }

  int64_t mark(int64_t b, int64_t i) {
    BucketIntake& bucket = this->bucket(b);
    SAPIPE_CHECK(!bucket.ready.at(i), "sapipe: gradient ", i, " of bucket ", b, " taken twice");
    bucket.ready[i] = 1;
    return ++bucket.num_ready;
  }

  bool any_ready() {
    for (const auto& bucket : state_->buckets)
      if (bucket.num_ready) return true;
    return false;
  }

  void clear() {
    for (auto& bucket : state_->buckets) {
      std::fill(bucket.ready.begin(), bucket.ready.end(), 0);
      bucket.num_ready = 0;
      bucket.route = Route::kUndecided;
      bucket.targets.clear();
    }
  }

  bool paused() const { return state_->paused; }
  void set_paused(bool paused) { state_->paused = paused; }
  void remove() { state_->remove(); }
  bool hooked() const { return !state_->hooks.empty(); }

 private:
  std::shared_ptr<IntakeState> state_;
};

}  // namespace

void define_intake(py::module_& m) {
  py::class_<GradientIntake>(m, "GradientIntake",
                             "Backward's gradients into their buckets, hooked on each parameter's "
                             "AccumulateGrad node (sapipe/runtime/intake.py).")
      .def(py::init<std::vector<at::Tensor>, py::object, py::object, py::object>(),
           py::arg("params"), py::arg("on_slow"), py::arg("on_first"), py::arg("on_complete"))
      .def("lay_out", &GradientIntake::lay_out, py::arg("bucket_of"), py::arg("position"),
           py::arg("sizes"))
      .def("num_ready", &GradientIntake::num_ready)
      .def("is_ready", &GradientIntake::is_ready)
      .def("mark", &GradientIntake::mark)
      .def("any_ready", &GradientIntake::any_ready)
      .def("clear", &GradientIntake::clear)
      .def_property("paused", &GradientIntake::paused, &GradientIntake::set_paused)
      .def("remove", &GradientIntake::remove)
      .def_property_readonly("hooked", &GradientIntake::hooked);
}

}  // namespace sapipe
