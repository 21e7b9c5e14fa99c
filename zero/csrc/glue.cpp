// libtorch glue that tch 0.26 does not expose (see DESIGN.md, "libtorch glue").
//
// Every entry point takes tch's tensor handle (an `at::Tensor*`, which
// tch's C++ calls `torch::Tensor*`: one type), catches
// every C++ exception and returns it as a heap string the Rust side frees with
// `zrt_free_error`; a null return means success. Nothing here may throw across
// the FFI boundary.
// Narrow headers, not <torch/torch.h>: the C++ frontend (nn, optim, data)
// is not used here, and parsing it was most of this file's compile time.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <unordered_set>
#include <vector>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>

namespace {

char *to_error(const std::string &msg) { return strdup(msg.c_str()); }

// A post-accumulate-grad hook calling back into Rust; owns `ctx`.
struct PostAccHook : torch::autograd::PostAccumulateGradHook {
  void (*cb)(void *);
  void (*drop)(void *);
  void *ctx;
  PostAccHook(void (*cb_)(void *), void (*drop_)(void *), void *ctx_) : cb(cb_), drop(drop_), ctx(ctx_) {}
  ~PostAccHook() override { drop(ctx); }
  PostAccHook(const PostAccHook &) = delete;
  PostAccHook &operator=(const PostAccHook &) = delete;
  void operator()(const torch::autograd::Variable & /*tensor*/) override { cb(ctx); }
};

// The Rust side of a checkpointed segment (`zrt_checkpoint`): `run(ctx,
// inputs, n, out)` computes the segment's output from `n` input handles it
// takes ownership of, storing a new handle in `*out`, and returns an error
// string (freed with `zrt_free_error`) or null; it must not unwind.
// `recomputed(ctx)` runs after a backward's recompute has accumulated the
// segment's parameter gradients, `drop(ctx)` when the graph that holds the
// segment is freed; neither may unwind.
struct Segment : torch::CustomClassHolder {
  char *(*run)(void *, at::Tensor **, size_t, at::Tensor **);
  void (*recomputed)(void *);
  void (*drop)(void *);
  void *ctx;
  // Whether the segment may draw random numbers (a dropout): the
  // generator's state is then kept for the recompute. An activation draws
  // none, and keeps no state.
  bool draws;
  Segment(char *(*run_)(void *, at::Tensor **, size_t, at::Tensor **), void (*recomputed_)(void *),
          void (*drop_)(void *), void *ctx_, bool draws_)
      : run(run_), recomputed(recomputed_), drop(drop_), ctx(ctx_), draws(draws_) {}
  ~Segment() override { drop(ctx); }
  Segment(const Segment &) = delete;
  Segment &operator=(const Segment &) = delete;

  // The output of a first run `zrt_checkpoint` already made (with its
  // graph, since dropped) and the generator's state before it; undefined
  // when `Recompute::forward` is to run the segment itself.
  at::Tensor first;
  at::Tensor first_rng;

  // Runs the segment on `inputs`; throws its error.
  at::Tensor call(const torch::autograd::variable_list &inputs) {
    // Owned here until `run` takes them (it wraps each as a Rust Tensor,
    // which deletes it), so an allocation that throws midway frees the
    // ones made before it.
    std::vector<std::unique_ptr<at::Tensor>> owned;
    owned.reserve(inputs.size());
    for (const auto &x : inputs) {
      owned.push_back(std::make_unique<at::Tensor>(x));
    }
    std::vector<at::Tensor *> handles;
    handles.reserve(owned.size());
    for (auto &h : owned) {
      handles.push_back(h.release());
    }
    at::Tensor *out = nullptr;
    char *err = run(ctx, handles.data(), handles.size(), &out);
    if (err != nullptr) {
      std::string msg(err);
      std::free(err);
      throw std::runtime_error(msg);
    }
    if (out == nullptr) {
      throw std::runtime_error("the checkpointed segment returned no tensor");
    }
    at::Tensor result = *out;
    delete out;
    return result;
  }
};

// The CPU generator's state, copied.
at::Tensor rng_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_rng_state(const at::Tensor &state) {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

// Whether the backward running on this thread runs every node
// (`loss.backward()`, or no backward at all) rather than only those some
// tensors' gradients need (`torch.autograd.grad(loss, x)`,
// `backward(inputs=)`), which capture instead of accumulating.
bool runs_every_node() {
  const auto *info = torch::autograd::get_current_graph_task_exec_info();
  return info == nullptr || info->empty();
}

// The backward that ran the outermost checkpointed segment being
// recomputed on this thread (-1: none; see `zrt_backward_id`).
thread_local int64_t outer_backward = -1;

// Marks a recompute's backward as part of the running one, for its
// duration.
struct InRecompute {
  bool set;
  InRecompute() : set(outer_backward < 0) {
    if (set) {
      outer_backward = torch::autograd::get_current_graph_task_id();
    }
  }
  ~InRecompute() {
    if (set) {
      outer_backward = -1;
    }
  }
  InRecompute(const InRecompute &) = delete;
  InRecompute &operator=(const InRecompute &) = delete;
};

// Activation checkpointing (PyTorch's reentrant `torch.utils.checkpoint`):
// forward runs the segment without building its graph and keeps only the
// inputs (and the CPU generator's state, so dropout draws the same masks);
// backward runs the segment again with its graph and back-propagates
// through it, which accumulates its parameters' gradients (firing their
// hooks) and yields the inputs' gradients. `anchor`, an empty leaf that
// requires grad, makes the output require grad even when no input does
// (the first block after a frozen embedding): the segment's parameters are
// not inputs, and backward would otherwise never reach them. Unlike
// PyTorch's reentrant checkpoint, which refuses `torch.autograd.grad`, it
// serves one too (input gradients, with `create_graph` for a gradient
// penalty), accumulating no parameter gradient.
struct Recompute : public torch::autograd::Function<Recompute> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext *ctx,
                                                c10::intrusive_ptr<Segment> segment,
                                                const at::Tensor & /*anchor*/,
                                                at::TensorList inputs) {
    // (A TensorList, not a vector: autograd counts each of its tensors as
    // an input; a vector would count as one non-tensor argument.)
    torch::autograd::variable_list xs(inputs.begin(), inputs.end());
    ctx->save_for_backward(xs);
    at::Tensor out;
    if (segment->first.defined()) {
      ctx->saved_data["rng"] = std::move(segment->first_rng);
      out = std::move(segment->first);
    } else {
      ctx->saved_data["rng"] = segment->draws ? rng_state() : at::Tensor();
      out = segment->call(xs);
    }
    ctx->saved_data["segment"] = c10::IValue::make_capsule(std::move(segment));
    return {out};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                 torch::autograd::variable_list grads) {
    auto segment = c10::static_intrusive_pointer_cast<Segment>(ctx->saved_data["segment"].toCapsule());
    // What the running backward asked for. One that runs every node
    // (`loss.backward()`) accumulates the segment's parameter gradients;
    // one that asked for some tensors' gradients only
    // (`torch.autograd.grad(loss, x)`: its graph task runs only the nodes
    // those need) must accumulate none, so the inputs' gradients are taken
    // with `grad`, which captures them. With `create_graph` the engine
    // runs this with grad mode on, and the gradients must keep their graph
    // (a gradient penalty back-propagates through them).
    const bool capture = !runs_every_node();
    const bool create = at::GradMode::is_enabled();
    if (create && !capture) {
      throw std::runtime_error(
          "backward with create_graph through a checkpointed block is not supported: take the gradients with "
          "torch.autograd.grad (tch: Tensor::run_backward) instead");
    }
    // The recompute runs on detached copies of the inputs, so that a
    // backward through it stops there (the forward's own nodes before the
    // segment run once, in the backward that called this). A gradient
    // whose graph is kept starts from the inputs themselves: a backward
    // through it must reach what they came from (the earlier segments'
    // parameters, through this gradient's dependence on the input), and
    // `grad` stops at them now.
    auto saved = ctx->get_saved_variables();
    torch::autograd::variable_list inputs;
    inputs.reserve(saved.size());
    for (const auto &x : saved) {
      inputs.push_back(create ? x : x.detach().requires_grad_(x.requires_grad()));
    }
    // The forward's random draws again, then the generator where it was
    // (a segment that draws none kept no state).
    const auto drawn = ctx->saved_data["rng"].toTensor();
    const auto now = drawn.defined() ? rng_state() : at::Tensor();
    if (drawn.defined()) {
      set_rng_state(drawn);
    }
    at::Tensor out;
    try {
      at::AutoGradMode grad(true);
      out = segment->call(inputs);
    } catch (...) {
      if (now.defined()) {
        set_rng_state(now);
      }
      throw;
    }
    if (now.defined()) {
      set_rng_state(now);
    }
    // One gradient per forward input: none for the segment and the
    // anchor, then each tensor's (undefined where it needs none).
    torch::autograd::variable_list result(inputs.size() + 2);
    if (!out.requires_grad()) {
      return result;
    }
    torch::autograd::variable_list wanted;
    std::vector<size_t> at;
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (inputs[i].requires_grad()) {
        wanted.push_back(inputs[i]);
        at.push_back(i + 2);
      }
    }
    InRecompute marked;
    torch::autograd::variable_list got;
    if (!capture) {
      torch::autograd::backward({out}, {grads[0]});
      for (const auto &x : wanted) {
        got.push_back(x.grad());
      }
      segment->recomputed(segment->ctx);
    } else if (!wanted.empty()) {
      got = torch::autograd::grad({out}, wanted, {grads[0]}, create, create, true);
    }
    for (size_t j = 0; j < got.size(); ++j) {
      result[at[j]] = got[j];
    }
    return result;
  }
};

// A gradient known only after the forward that used it: `Deferred` passes
// `y` through (a view of it) and, in backward, hands `s` the gradient `w`
// times `scale[0]`, tensors its caller fills between forward and backward
// (kept in `saved_data`, which autograd does not version-check). It adds
// to the loss a term whose gradient in `s` is known only once every layer
// has run (a router's load-balancing loss over all of them) without a
// second output per layer: the layer stays one input, one output, under
// activation checkpointing too. `scale` NaN means the loss holding the term
// has not been back-propagated through yet (`Probe` sets it), and throws.
struct Deferred : public torch::autograd::Function<Deferred> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext *ctx, const at::Tensor &y,
                                                const at::Tensor &s, at::Tensor w, at::Tensor scale) {
    ctx->saved_data["w"] = std::move(w);
    ctx->saved_data["scale"] = std::move(scale);
    ctx->saved_data["s"] = s.detach();
    return {y.view_as(y)};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                 torch::autograd::variable_list grads) {
    at::NoGradGuard no_grad;
    const double scale = ctx->saved_data["scale"].toTensor().item<double>();
    if (std::isnan(scale)) {
      throw std::runtime_error(
          "the router's load-balancing gradient was reached before the loss holding it: back-propagate from "
          "the loss the model returned (or plus_router_loss made), not from another tensor of the same forward");
    }
    const auto s = ctx->saved_data["s"].toTensor();
    auto gs = (ctx->saved_data["w"].toTensor().to(s.options()) * scale).reshape(s.sizes());
    return {grads[0], gs, at::Tensor(), at::Tensor()};
  }
};

// Returns a copy of `value` whose backward writes the gradient it is given
// into `scale` (one element) and goes no further: the seed that
// `Deferred`'s gradients are scaled by (a loss scale, 1 / accumulation
// steps). `anchor`, an empty leaf that requires grad, puts it in the graph.
struct Probe : public torch::autograd::Function<Probe> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext *ctx, const at::Tensor &value,
                                                const at::Tensor & /*anchor*/, at::Tensor scale) {
    ctx->saved_data["scale"] = std::move(scale);
    return {value.clone()};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                 torch::autograd::variable_list grads) {
    at::NoGradGuard no_grad;
    auto scale = ctx->saved_data["scale"].toTensor();
    scale.copy_(grads[0].detach().reshape({1}));
    return {at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

extern "C" {

void zrt_free_error(char *err) { std::free(err); }

// The tensor's storage: its length in bytes and where its data is (a freed
// storage's data is null or a guard, see `zrt_storage_free`).
char *zrt_storage_nbytes(const at::Tensor *t, size_t *out, const void **data) {
  try {
    c10::StorageImpl *s = t->storage().unsafeGetStorageImpl();
    *out = s->nbytes();
    *data = s->data_ptr().get();
    return nullptr;
  } catch (const std::exception &e) {
    return to_error(e.what());
  }
}

// Releases the memory behind a tensor's storage, keeping the storage object
// (and with it every view and every autograd node that saved one) alive.
// This is FSDP's `untyped_storage().resize_(0)`, with one difference: given
// a `guard` (reserved, inaccessible address space at least as long as the
// storage; CPU only), the storage keeps its length and points there, so a
// reader that copies its bytes faults in the guard (and the Rust side
// explains why) instead of reading null or writing a zero-byte copy.
// Without one it has no data and zero bytes. Either way it stays freed until
// `zrt_storage_realloc` or `zrt_storage_adopt` gives it memory. The guard
// is not owned: nothing is released when the storage lets go of it.
char *zrt_storage_free(at::Tensor *t, void *guard) {
  try {
    c10::StorageImpl *s = t->storage().unsafeGetStorageImpl();
    if (!s->resizable()) {
      return to_error("storage is not resizable (it wraps memory torch does not own)");
    }
    if (guard != nullptr && s->device().type() == c10::DeviceType::CPU) {
      s->set_data_ptr_noswap(c10::DataPtr(guard, s->device()));
    } else {
      s->set_data_ptr_noswap(c10::DataPtr(nullptr, s->device()));
      s->set_nbytes(0);
    }
    return nullptr;
  } catch (const std::exception &e) {
    return to_error(e.what());
  }
}

// Gives a (freed) storage `nbytes` of fresh, uninitialised memory from its own
// allocator, on its own device. Views keep their offsets and strides, so they
// see the new memory once the caller refills it.
char *zrt_storage_realloc(at::Tensor *t, size_t nbytes) {
  try {
    c10::StorageImpl *s = t->storage().unsafeGetStorageImpl();
    if (!s->resizable()) {
      return to_error("storage is not resizable (it wraps memory torch does not own)");
    }
    c10::Allocator *alloc = s->allocator();
    if (alloc == nullptr) {
      return to_error("storage has no allocator");
    }
    s->set_data_ptr_noswap(alloc->allocate(nbytes));
    s->set_nbytes(nbytes);
    return nullptr;
  } catch (const std::exception &e) {
    return to_error(e.what());
  }
}

// Gives a (freed) CPU storage memory the caller already holds: `data`,
// `nbytes` long, released by `del(ctx)` when the storage lets go of it (freed,
// re-allocated or destroyed). On error the storage is unchanged and the
// caller still owns `ctx`. This is how a gathered buffer becomes a unit's
// parameters without a copy.
char *zrt_storage_adopt(at::Tensor *t, void *data, size_t nbytes, void *ctx, void (*del)(void *)) {
  try {
    c10::StorageImpl *s = t->storage().unsafeGetStorageImpl();
    if (!s->resizable()) {
      return to_error("storage is not resizable (it wraps memory torch does not own)");
    }
    if (s->device().type() != c10::DeviceType::CPU) {
      return to_error("only a CPU storage can adopt host memory");
    }
    s->set_data_ptr_noswap(c10::DataPtr(data, ctx, del, s->device()));
    s->set_nbytes(nbytes);
    return nullptr;
  } catch (const std::exception &e) {
    return to_error(e.what());
  }
}

// A new tensor over the same storage, offset, sizes and strides as `t`, but
// with its own autograd version counter and no autograd history. Writing
// through it (the refill after `zrt_storage_realloc`, or a collective writing
// the gathered buffer) does not bump the version of the views autograd saved,
// so backward accepts them — the role `_unsafe_preserve_version_counter`
// plays in FSDP2. The caller owns `*out` (tch frees it).
char *zrt_untracked_alias(const at::Tensor *t, at::Tensor **out) {
  try {
    at::NoGradGuard no_grad;
    at::Tensor alias = at::empty({0}, t->options());
    alias.set_(t->storage(), t->storage_offset(), t->sizes(), t->strides());
    *out = new at::Tensor(std::move(alias));
    return nullptr;
  } catch (const std::exception &e) {
    return to_error(e.what());
  }
}

// Moves the gradient accumulated into a `zrt_grad_alias` leaf into its
// target's `.grad` (adds it when the target has one), leaving the alias
// with none.
struct MoveGradInto : torch::autograd::PostAccumulateGradHook {
  at::Tensor target;
  explicit MoveGradInto(at::Tensor t) : target(std::move(t)) {}
  void operator()(const torch::autograd::Variable &alias) override {
    at::Tensor g = alias.grad();
    if (!g.defined()) {
      return;
    }
    alias.mutable_grad() = at::Tensor();
    at::Tensor &dst = target.mutable_grad();
    if (!dst.defined()) {
      dst = std::move(g);
    } else if (dst.is_sparse() && !g.is_sparse()) {
      dst = g.add_(dst);  // a sparse sum cannot hold a dense one: g takes it
    } else {
      dst.add_(g);
    }
  }
};

// A new leaf over `t`'s storage (its values, its version counter), that
// requires grad, whose gradient each backward moves into `t`'s `.grad`
// as soon as it is accumulated. A use of `t` through it hands its
// gradient over at once, where uses of `t` itself wait in libtorch's input
// buffer for each other and are summed into a new tensor. The caller owns
// `*out` (tch frees it).
char *zrt_grad_alias(const at::Tensor *t, at::Tensor **out) {
  try {
    if (!t->requires_grad() || !t->is_leaf()) {
      return to_error("a gradient alias needs a leaf that requires grad");
    }
    at::Tensor alias = t->detach().requires_grad_(true);
    torch::autograd::impl::set_post_acc_grad_hooks(alias, std::make_unique<MoveGradInto>(*t));
    *out = new at::Tensor(std::move(alias));
    return nullptr;
  } catch (const std::exception &e) {
    return to_error(e.what());
  }
}

// Drops a tensor's `.grad` (tch has no setter): the engine copies gradients
// into its flat buffers and must not keep a second full copy alive.
char *zrt_clear_grad(at::Tensor *t) {
  try {
    t->mutable_grad() = at::Tensor();
    return nullptr;
  } catch (const std::exception &e) {
    return to_error(e.what());
  }
}

// Calls `cb(ctx)` when the gradient with respect to `t` has been computed
// (before autograd runs the nodes that consume it), without changing the
// gradient. `drop(ctx)` runs when autograd releases the hook (the graph is
// freed), so the Rust side can free `ctx`. `cb` must not unwind.
char *zrt_register_grad_hook(at::Tensor *t, void (*cb)(void *), void (*drop)(void *), void *ctx) {
  try {
    if (!t->requires_grad()) {
      drop(ctx);
      return to_error("the tensor does not require grad: no backward will reach it");
    }
    std::shared_ptr<void> owner(ctx, drop);
    t->register_hook([cb, owner](const at::Tensor &) { cb(owner.get()); });
    return nullptr;
  } catch (const std::exception &e) {
    return to_error(e.what());
  }
}

// Calls `cb(ctx)` each time backward has accumulated a gradient into the
// leaf `t`'s `.grad` (PyTorch's `register_post_accumulate_grad_hook`; a leaf
// has one such slot, which this replaces). `drop(ctx)` runs when the hook is
// replaced or the tensor dies, and on error. `cb` must not unwind.
char *zrt_register_post_acc_hook(at::Tensor *t, void (*cb)(void *), void (*drop)(void *), void *ctx) {
  std::unique_ptr<PostAccHook> hook;
  try {
    hook = std::make_unique<PostAccHook>(cb, drop, ctx);
  } catch (const std::exception &e) {
    drop(ctx);
    return to_error(e.what());
  }
  try {
    if (!t->requires_grad() || !t->is_leaf()) {
      return to_error("post-accumulate-grad hooks need a leaf that requires grad");
    }
    torch::autograd::impl::set_post_acc_grad_hooks(*t, std::move(hook));
    return nullptr;
  } catch (const std::exception &e) {
    return to_error(e.what());
  }
}

// Which backward runs on this thread (-1: none): libtorch's graph task id,
// or, inside a checkpointed segment's recompute (a backward of its own),
// the id of the backward that ran the segment's node, so that gradients
// the recompute accumulates count as that backward's.
char *zrt_backward_id(int64_t *out) {
  try {
    *out = outer_backward >= 0 ? outer_backward : torch::autograd::get_current_graph_task_id();
    return nullptr;
  } catch (const std::exception &e) {
    return to_error(e.what());
  }
}

// Whether the backward running on this thread keeps its graph (`*out` 1:
// `retain_graph`, `create_graph`, so another backward may run through the
// same nodes and their saved tensors) or frees it (0). Outside a backward: 1.
char *zrt_graph_kept(int *out) {
  try {
    *out = torch::autograd::get_current_graph_task_keep_graph() ? 1 : 0;
    return nullptr;
  } catch (const std::exception &e) {
    return to_error(e.what());
  }
}

// Whether the backward running on this thread accumulates a gradient into
// the leaf `t`'s `.grad` (`*out` 1) or not (0): one that asked for other
// tensors' gradients only (`torch.autograd.grad(loss, x)`, `backward(inputs=)`)
// runs only the nodes those need, and captures rather than accumulates.
// Outside a backward, or in one that runs every node, 1 when `t` requires
// grad: its accumulator may not exist yet (a checkpointed segment's
// recompute makes it later in the backward). PyTorch's
// `_will_engine_execute_node`.
char *zrt_will_accumulate(const at::Tensor *t, int *out) {
  try {
    if (runs_every_node()) {
      *out = t->requires_grad() ? 1 : 0;
      return nullptr;
    }
    auto acc = torch::autograd::impl::try_get_grad_accumulator(*t);
    if (!acc) {
      *out = 0;
      return nullptr;
    }
    const auto *info = torch::autograd::get_current_graph_task_exec_info();
    auto it = info->find(acc.get());
    *out = (it != info->end() && it->second.needed_) ? 1 : 0;
    return nullptr;
  } catch (const std::exception &e) {
    return to_error(e.what());
  }
}

// The address of the TensorImpl behind `t` (what autograd's leaves refer to).
char *zrt_tensor_impl(const at::Tensor *t, const void **out) {
  try {
    *out = t->unsafeGetTensorImpl();
    return nullptr;
  } catch (const std::exception &e) {
    return to_error(e.what());
  }
}

// The leaves (their TensorImpl addresses) autograd would accumulate into
// when backpropagating from `t`, not looking past `stop`'s grad_fn (a unit's
// input): the parameters a unit's forward used. Writes at most `cap`
// addresses to `out` and the count found to `len`.
char *zrt_graph_leaves(const at::Tensor *t, const at::Tensor *stop, const void **out, size_t cap, size_t *len) {
  try {
    *len = 0;
    auto root = t->grad_fn();
    if (!root) {
      return nullptr;
    }
    torch::autograd::Node *stop_node = nullptr;
    if (stop != nullptr && stop->defined() && stop->grad_fn()) {
      stop_node = stop->grad_fn().get();
    }
    std::vector<torch::autograd::Node *> todo{root.get()};
    std::unordered_set<torch::autograd::Node *> seen;
    while (!todo.empty()) {
      torch::autograd::Node *n = todo.back();
      todo.pop_back();
      if (n == nullptr || n == stop_node || !seen.insert(n).second) {
        continue;
      }
      if (auto *acc = dynamic_cast<torch::autograd::AccumulateGrad *>(n)) {
        if (*len < cap) {
          out[*len] = acc->variable.unsafeGetTensorImpl();
        }
        (*len)++;
        continue;
      }
      for (const auto &e : n->next_edges()) {
        if (e.function) {
          todo.push_back(e.function.get());
        }
      }
    }
    return nullptr;
  } catch (const std::exception &e) {
    return to_error(e.what());
  }
}

// The state of libtorch's default CPU generator (what `torch.get_rng_state()`
// returns): checkpoints save it so dropout and `randn` resume where they were.
// With `out` null only the size is reported.
char *zrt_cpu_rng_get(uint8_t *out, size_t cap, size_t *len) {
  try {
    auto gen = at::detail::getDefaultCPUGenerator();
    at::Tensor state;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      state = gen.get_state();
    }
    *len = static_cast<size_t>(state.numel());
    if (out != nullptr) {
      if (cap < *len) {
        return to_error("rng state buffer too small");
      }
      std::memcpy(out, state.data_ptr<uint8_t>(), *len);
    }
    return nullptr;
  } catch (const std::exception &e) {
    return to_error(e.what());
  }
}

// Restores a state `zrt_cpu_rng_get` returned (libtorch validates it).
char *zrt_cpu_rng_set(const uint8_t *in, size_t len) {
  try {
    auto state = at::empty({static_cast<int64_t>(len)}, at::kByte);
    std::memcpy(state.data_ptr<uint8_t>(), in, len);
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state);
    return nullptr;
  } catch (const std::exception &e) {
    return to_error(e.what());
  }
}

// Runs a checkpointed segment on the `n` tensors `inputs` (see `Segment`
// and `Recompute`): `*out` receives its output, whose backward recomputes
// it. Owns `ctx` from here on: `drop(ctx)` runs when the graph is freed, at
// once when the output needs no gradient, and on error.
char *zrt_checkpoint(at::Tensor *const *inputs, size_t n,
                     char *(*run)(void *, at::Tensor **, size_t, at::Tensor **),
                     void (*recomputed)(void *), void (*drop)(void *), void *ctx, bool draws,
                     at::Tensor **out) {
  c10::intrusive_ptr<Segment> segment;
  try {
    segment = c10::make_intrusive<Segment>(run, recomputed, drop, ctx, draws);
  } catch (const std::exception &e) {
    drop(ctx);
    return to_error(e.what());
  }
  try {
    torch::autograd::variable_list xs;
    xs.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      xs.push_back(*inputs[i]);
    }
    // No input needs a gradient: run the segment once with its graph, to
    // learn whether its parameters need any. If none does (a frozen block
    // after a frozen embedding), that output is the answer and backward
    // never comes back here: no recompute, and no gather for one at stage
    // 3. The graph lives only while one block runs, as the recompute's
    // does in backward. Otherwise the output is kept, without its graph,
    // and the anchor (see `Recompute`) takes over.
    bool any_input_grad = std::any_of(xs.begin(), xs.end(), [](const at::Tensor &x) { return x.requires_grad(); });
    if (!any_input_grad && at::GradMode::is_enabled()) {
      auto rng = draws ? rng_state() : at::Tensor();
      auto y = segment->call(xs);
      if (!y.requires_grad()) {
        *out = new at::Tensor(std::move(y));
        return nullptr;
      }
      segment->first = y.detach();
      segment->first_rng = std::move(rng);
    }
    auto anchor = at::empty({0}).requires_grad_(true);
    auto ys = Recompute::apply(std::move(segment), anchor, at::TensorList(xs));
    *out = new at::Tensor(ys.at(0));
    return nullptr;
  } catch (const std::exception &e) {
    return to_error(e.what());
  }
}

// `y` through `Deferred` (see there) with `s`, `w` and `scale`.
char *zrt_deferred(const at::Tensor *y, const at::Tensor *s, const at::Tensor *w, const at::Tensor *scale,
                   at::Tensor **out) {
  try {
    auto ys = Deferred::apply(*y, *s, *w, *scale);
    *out = new at::Tensor(ys.at(0));
    return nullptr;
  } catch (const std::exception &e) {
    return to_error(e.what());
  }
}

// `value` through `Probe` (see there) into `scale`.
char *zrt_probe(const at::Tensor *value, const at::Tensor *scale, at::Tensor **out) {
  try {
    auto anchor = at::empty({0}).requires_grad_(true);
    auto ys = Probe::apply(*value, anchor, *scale);
    *out = new at::Tensor(ys.at(0));
    return nullptr;
  } catch (const std::exception &e) {
    return to_error(e.what());
  }
}

}  // extern "C"
