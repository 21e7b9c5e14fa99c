// A cross-entropy that keeps the logits it was given for backward, not
// their fp32 log-probabilities (see `glue/loss.rs`).
//
// libtorch's `cross_entropy` of logits cast to fp32 keeps the whole
// `[rows, vocab]` log-softmax in fp32 for its backward: at a 128k or 256k
// vocabulary that is the largest tensor a forward keeps. This node keeps
// the logits themselves (in their own dtype, often a view of the head's
// output, which nothing else keeps) and computes the log-softmax again in
// backward, a block of rows at a time, so no fp32 copy of the whole matrix
// exists in forward or backward either.
//
// As in glue.cpp, every entry point catches every C++ exception and
// returns it as a heap string; a null return means success.
#include <ATen/core/Tensor.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/_log_softmax_backward_data.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/log_softmax.h>
#include <ATen/ops/nll_loss.h>
#include <ATen/ops/nll_loss_backward.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cstring>
#include <string>

namespace {

char *loss_error(const std::string &msg) { return strdup(msg.c_str()); }

// Rows a block takes so that its fp32 copy is about 32 MiB.
int64_t block_rows(int64_t vocab) { return std::max<int64_t>(1, (int64_t{8} << 20) / std::max<int64_t>(vocab, 1)); }

// What the softmax is computed in: fp32, or the logits' dtype when wider.
at::ScalarType compute_type(const at::Tensor &logits) {
  return at::promote_types(logits.scalar_type(), at::kFloat);
}

struct CrossEntropy : public torch::autograd::Function<CrossEntropy> {
  // `logits` `[rows, vocab]`, `targets` `[rows]` int64; rows whose target
  // is `ignore` count nothing. The sum over the counted rows of their
  // negative log-probability at the target, divided by how many were
  // counted when `mean` (NaN when none is, as libtorch's mean over
  // nothing). Each block runs libtorch's own log-softmax and NLL kernels
  // on its rows, as the whole matrix in fp32 would: the same values to
  // the bit row by row, in forward and in backward.
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext *ctx, const at::Tensor &logits,
                                                const at::Tensor &targets, int64_t ignore, bool mean) {
    const int64_t rows = logits.size(0), block = block_rows(logits.size(1));
    const auto fp = compute_type(logits);
    auto loss = at::zeros({}, logits.options().dtype(fp));
    for (int64_t a = 0; a < rows; a += block) {
      const int64_t n = std::min(block, rows - a);
      const auto logp = at::log_softmax(logits.narrow(0, a, n).to(fp), 1);
      loss += at::nll_loss(logp, targets.narrow(0, a, n), {}, at::Reduction::Sum, ignore);
    }
    auto count = targets.ne(ignore).sum().to(fp);
    if (mean) {
      loss = loss / count;
    }
    ctx->save_for_backward({logits, targets, count});
    ctx->saved_data["ignore"] = ignore;
    ctx->saved_data["mean"] = mean;
    return {loss};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &logits = saved[0], &targets = saved[1], &count = saved[2];
    const int64_t ignore = ctx->saved_data["ignore"].toInt();
    const bool mean = ctx->saved_data["mean"].toBool();
    const int64_t rows = logits.size(0), block = block_rows(logits.size(1));
    const auto fp = compute_type(logits);
    // libtorch's mean divides the seed by the count, then the NLL's
    // backward puts its negative at each target.
    auto seed = grads[0].to(fp);
    if (mean) {
      seed = seed / count;
    }
    auto grad = at::empty_like(logits, at::MemoryFormat::Contiguous);
    for (int64_t a = 0; a < rows; a += block) {
      const int64_t n = std::min(block, rows - a);
      const auto t = targets.narrow(0, a, n);
      const auto logp = at::log_softmax(logits.narrow(0, a, n).to(fp), 1);
      // A sum's backward reads no total weight (the mean divided above).
      const auto dlogp = at::nll_loss_backward(seed, logp, t, {}, at::Reduction::Sum, ignore, count);
      grad.narrow(0, a, n).copy_(at::_log_softmax_backward_data(dlogp, logp, 1, fp));
    }
    return {grad, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

extern "C" {

// `CrossEntropy` (see there) of `logits` against `targets` into `*out`.
char *zrt_cross_entropy(const at::Tensor *logits, const at::Tensor *targets, int64_t ignore, int mean,
                        at::Tensor **out) {
  try {
    if (logits->dim() != 2 || targets->dim() != 1 || targets->size(0) != logits->size(0)) {
      return loss_error("cross_entropy takes logits [rows, vocab] and targets [rows], got " +
                        std::to_string(logits->dim()) + "-D logits and " + std::to_string(targets->dim()) +
                        "-D targets of other rows");
    }
    if (targets->scalar_type() != at::kLong) {
      return loss_error("cross_entropy takes int64 targets");
    }
    auto ys = CrossEntropy::apply(*logits, *targets, ignore, mean != 0);
    *out = new at::Tensor(ys.at(0));
    return nullptr;
  } catch (const std::exception &e) {
    return loss_error(e.what());
  }
}

}  // extern "C"
