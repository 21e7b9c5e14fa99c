// Counting the multiply-accumulates of matrix products as libtorch runs
// them, for the flops profiler (DeepSpeed's `flops_profiler`).
//
// A global RecordFunction callback sees the operators the dispatcher
// runs, with their inputs. It is registered only while some thread counts
// (each operator call pays for it), and counts only on threads that asked
// to: ranks that are threads of one process count apart. A composite
// product (linear, matmul, scaled_dot_product_attention) is counted from
// its own inputs, and the products it runs inside are not, so each
// counts once whichever path libtorch takes inside it. The leaf kernels
// (mm, addmm, bmm, baddbmm, the fused attention kernels) count when
// called directly.

// RecordFunction::inputs() asserts, in a build without NDEBUG, a flag
// that only a libtorch built without NDEBUG sets: the pip wheel's sets it
// in no call it makes itself (a matmul inside a linear), so the check
// would refuse every such operator's inputs, which are there all the same.
#ifndef NDEBUG
#define NDEBUG
#endif

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <ATen/record_function.h>

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <mutex>
#include <string>

namespace {

char *flops_error(const std::string &msg) { return strdup(msg.c_str()); }

thread_local bool counting = false;
thread_local int64_t macs = 0;
// Counted composites under way on this thread: what runs inside them is
// theirs.
thread_local int inside = 0;

// The context of a counted composite, so its end is known.
struct Counted : at::ObserverContext {};

std::mutex users_mutex;
int users = 0;
at::CallbackHandle handle = 0;

// Input `i`'s sizes, if it is a tensor of `dims` dimensions.
bool sizes_of(const at::RecordFunction &fn, size_t i, size_t dims, c10::IntArrayRef *out) {
  auto in = fn.inputs();
  if (i >= in.size() || !in[i].isTensor()) {
    return false;
  }
  const auto &t = in[i].toTensor();
  if (!t.defined() || t.dim() != static_cast<int64_t>(dims)) {
    return false;
  }
  *out = t.sizes();
  return true;
}

// [m, k] x [k, n] at inputs a and b.
int64_t mm_macs(const at::RecordFunction &fn, size_t a, size_t b) {
  c10::IntArrayRef x, y;
  if (!sizes_of(fn, a, 2, &x) || !sizes_of(fn, b, 2, &y)) {
    return 0;
  }
  return x[0] * x[1] * y[1];
}

// [B, m, k] x [B, k, n] at inputs a and b.
int64_t bmm_macs(const at::RecordFunction &fn, size_t a, size_t b) {
  c10::IntArrayRef x, y;
  if (!sizes_of(fn, a, 3, &x) || !sizes_of(fn, b, 3, &y)) {
    return 0;
  }
  return x[0] * x[1] * x[2] * y[2];
}

// Attention over q [B, H, L, E], k [B, H, S, E], v [B, H, S, Ev]: q k^T
// and its weights times v, whole (a causal mask's skipped half counted,
// as DeepSpeed's profiler counts it).
int64_t attention_macs(const at::RecordFunction &fn) {
  c10::IntArrayRef q, k, v;
  if (!sizes_of(fn, 0, 4, &q) || !sizes_of(fn, 1, 4, &k) || !sizes_of(fn, 2, 4, &v)) {
    return 0;
  }
  return q[0] * q[1] * q[2] * k[2] * (q[3] + v[3]);
}

// Any-dimensional input `i`'s sizes, if it is a tensor.
bool any_sizes(const at::RecordFunction &fn, size_t i, c10::IntArrayRef *out) {
  auto in = fn.inputs();
  if (i >= in.size() || !in[i].isTensor() || !in[i].toTensor().defined()) {
    return false;
  }
  *out = in[i].toTensor().sizes();
  return true;
}

// linear(x [..., in], w [out, in]): every row of x times w.
int64_t linear_macs(const at::RecordFunction &fn) {
  c10::IntArrayRef x, w;
  if (!any_sizes(fn, 0, &x) || !sizes_of(fn, 1, 2, &w)) {
    return 0;
  }
  int64_t elems = 1;
  for (auto d : x) {
    elems *= d;
  }
  return elems * w[0];  // each of x's elements meets `out` weights
}

// matmul(a, b) under torch.matmul's rules: 1-D operands are a row or a
// column, leading dimensions broadcast.
int64_t matmul_macs(const at::RecordFunction &fn) {
  c10::IntArrayRef a, b;
  if (!any_sizes(fn, 0, &a) || !any_sizes(fn, 1, &b) || a.empty() || b.empty()) {
    return 0;
  }
  int64_t n = a.size() >= 2 ? a[a.size() - 2] : 1;
  int64_t k = a[a.size() - 1];
  int64_t m = b.size() >= 2 ? b[b.size() - 1] : 1;
  size_t ab = a.size() >= 2 ? a.size() - 2 : 0;
  size_t bb = b.size() >= 2 ? b.size() - 2 : 0;
  int64_t batch = 1;
  for (size_t i = 0; i < std::max(ab, bb); ++i) {
    int64_t x = i < ab ? a[ab - 1 - i] : 1;
    int64_t y = i < bb ? b[bb - 1 - i] : 1;
    batch *= std::max(x, y);
  }
  return batch * n * k * m;
}

// What a composite product multiplies, or -1 for another operator.
int64_t composite_macs(const char *name, const at::RecordFunction &fn) {
  if (std::strcmp(name, "aten::linear") == 0) {
    return linear_macs(fn);
  }
  if (std::strcmp(name, "aten::matmul") == 0) {
    return matmul_macs(fn);
  }
  if (std::strcmp(name, "aten::scaled_dot_product_attention") == 0) {
    return attention_macs(fn);
  }
  return -1;
}

std::unique_ptr<at::ObserverContext> on_op(const at::RecordFunction &fn) {
  if (!counting) {
    return nullptr;
  }
  const char *name = fn.name();
  int64_t composite = composite_macs(name, fn);
  if (composite >= 0) {
    if (inside == 0) {
      macs += composite;
    }
    inside += 1;
    return std::make_unique<Counted>();
  }
  if (inside > 0) {
    return nullptr;
  }
  if (std::strcmp(name, "aten::mm") == 0) {
    macs += mm_macs(fn, 0, 1);
  } else if (std::strcmp(name, "aten::addmm") == 0) {
    macs += mm_macs(fn, 1, 2);
  } else if (std::strcmp(name, "aten::bmm") == 0) {
    macs += bmm_macs(fn, 0, 1);
  } else if (std::strcmp(name, "aten::baddbmm") == 0) {
    macs += bmm_macs(fn, 1, 2);
  } else if (std::strcmp(name, "aten::_scaled_dot_product_flash_attention_for_cpu") == 0 ||
             std::strcmp(name, "aten::_scaled_dot_product_flash_attention") == 0 ||
             std::strcmp(name, "aten::_scaled_dot_product_efficient_attention") == 0 ||
             std::strcmp(name, "aten::_scaled_dot_product_cudnn_attention") == 0) {
    macs += attention_macs(fn);
  }
  return nullptr;
}

void on_op_end(const at::RecordFunction &, at::ObserverContext *ctx) {
  if (ctx != nullptr && inside > 0) {
    inside -= 1;
  }
}

}  // namespace

extern "C" {

// Starts (`on` 1) or stops (0) counting on this thread; the callback is
// registered while any thread counts.
char *zrt_flops_count(int on) {
  try {
    std::lock_guard<std::mutex> lock(users_mutex);
    bool want = on != 0;
    if (want == counting) {
      return nullptr;
    }
    if (want) {
      inside = 0;
      if (users == 0) {
        handle = at::addGlobalCallback(at::RecordFunctionCallback(&on_op, &on_op_end)
                                           .needsInputs(true)
                                           .scopes({at::RecordScope::FUNCTION}));
      }
      users += 1;
    } else {
      users -= 1;
      if (users == 0) {
        at::removeCallback(handle);
        handle = 0;
      }
    }
    counting = want;
    return nullptr;
  } catch (const std::exception &e) {
    return flops_error(e.what());
  }
}

// The multiply-accumulates counted on this thread so far.
int64_t zrt_flops_macs() { return macs; }

}  // extern "C"
