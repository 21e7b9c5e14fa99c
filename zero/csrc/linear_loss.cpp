// A language model's head and its cross-entropy in one node that never
// holds the whole `[rows, vocab]` logits (see `glue/linear_loss.rs`).
//
// Unfused, the head's output is the largest tensor of a step at a large
// vocabulary: kept for the loss's backward, and its gradient, as large,
// made at the start of backward while every layer's tensors are still
// held. This node keeps the hidden states, the head's matrix (both kept
// by the head's own backward anyway) and one fp32 log-sum-exp a row. Its
// forward computes the logits a block of vocabulary columns at a time,
// every row in each block, keeping each row's log-sum-exp running; its
// backward computes them again the same way, so that each block's rows
// of the matrix's gradient are one product over every row, as the
// unfused head's are, and only the hidden states' gradient is summed
// over blocks (in fp32, then rounded once). When one block holds every
// column (a block holds `block_logits` logits: Rust's `BLOCK_LOGITS`), forward runs
// the unfused loss's own kernels and keeps their log-probabilities, as the
// unfused loss does, so that backward does not compute them again: the
// fused loss then costs no more time than the unfused one. When the
// matrix is frozen (LoRA) and takes more than one block, forward computes
// the hidden states' gradient as it goes (each block's unnormalized
// softmax times its rows of the matrix, the sum rescaled as each row's
// largest logit grows) and keeps that gradient alone: backward scales it
// by the seed and computes nothing again. That is two products of the
// head's size, as many as the unfused head and loss run.
//
// As in glue.cpp, every entry point catches every C++ exception and
// returns it as a heap string; a null return means success.
#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/_log_softmax_backward_data.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/log_softmax.h>
#include <ATen/ops/logsumexp.h>
#include <ATen/ops/maximum.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/nll_loss.h>
#include <ATen/ops/nll_loss_backward.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/tanh.h>
#include <ATen/ops/tanh_backward.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <ATen/TensorIndexing.h>
#include <ATen/TensorOperators.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace {

char *linear_loss_error(const std::string &msg) { return strdup(msg.c_str()); }

// The columns of a block of `logits` logits over `across` rows: at least one.
int64_t block_of(int64_t logits, int64_t across) { return std::max<int64_t>(1, logits / std::max<int64_t>(across, 1)); }

// What the model does to the head's output before the loss, in its order
// and with its ops: a bias added after the product (CTRL's tied head's),
// a division (Granite's `logits_scaling`), a multiplication (Cohere's
// `logit_scale`) and a soft cap (Gemma 2's `final_logit_softcapping`:
// `tanh(z / cap) * cap`). 1, 1 and 0 leave the logits as they are.
struct Post {
  bool bias_after;
  double divide;
  double multiply;
  double cap;
};

// The logits of `h` by `w` (and `b`: inside the product, or after it
// when `post.bias_after`), with `post` applied; `capped` gets the tanh
// the soft cap's backward reads.
at::Tensor logits_of(const at::Tensor &h, const at::Tensor &w, const at::Tensor &b, const Post &post,
                     at::Tensor *capped) {
  auto z = (b.defined() && !post.bias_after) ? at::linear(h, w, b) : at::linear(h, w);
  if (b.defined() && post.bias_after) {
    z = z + b;
  }
  if (post.divide != 1.0) {
    z = z / post.divide;
  }
  if (post.multiply != 1.0) {
    z = z * post.multiply;
  }
  if (post.cap > 0.0) {
    auto t = at::tanh(z / post.cap);
    z = t * post.cap;
    if (capped != nullptr) {
      *capped = t;
    }
  }
  return z;
}

// The gradient at the product's output, given the logits' `dz`: the
// backward of `logits_of`'s steps after the product, with the kernels
// autograd runs for them.
at::Tensor before_post(at::Tensor dz, const at::Tensor &capped, const Post &post) {
  if (post.cap > 0.0) {
    dz = at::tanh_backward(dz * post.cap, capped) / post.cap;
  }
  if (post.multiply != 1.0) {
    dz = dz * post.multiply;
  }
  if (post.divide != 1.0) {
    dz = dz / post.divide;
  }
  return dz;
}

// Backward's outputs: a gradient (or none) for each of forward's 12
// arguments, of which only the hidden states, the matrix and the bias
// can take one.
torch::autograd::variable_list gradients(at::Tensor h, at::Tensor w, at::Tensor b) {
  torch::autograd::variable_list out(12);
  out[0] = std::move(h);
  out[1] = std::move(w);
  out[2] = std::move(b);
  return out;
}

struct LinearCrossEntropy : public torch::autograd::Function<LinearCrossEntropy> {
  // `h` `[rows, width]`, `w` `[vocab, width]`, `b` `[vocab]` or undefined,
  // `targets` `[rows]` int64 (`ignore`: not counted). The cross-entropy
  // of the logits `post(h wᵀ + b)` in fp32 (or a wider dtype of h's):
  // their sum over the counted rows, or with `mean` their mean (NaN when
  // none counts, as libtorch's). Each block is at most `logits` logits
  // (a whole number of columns over every row, at least one column).
  // With `ahead` (only the hidden states need a gradient), a forward of
  // more than one block computes their gradient and keeps nothing else.
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext *ctx, const at::Tensor &h,
                                                const at::Tensor &w, const std::optional<at::Tensor> &bias,
                                                const at::Tensor &targets, int64_t ignore, bool mean,
                                                bool bias_after, double divide, double multiply, double cap,
                                                int64_t logits, bool ahead) {
    // An optional bias: an undefined tensor among the inputs would have
    // autograd describe a tensor that is not there.
    const auto b = bias.value_or(at::Tensor());
    const Post post{bias_after, divide, multiply, cap};
    const int64_t rows = h.size(0), vocab = w.size(0), block = block_of(logits, rows);
    const auto fp = at::promote_types(h.scalar_type(), at::kFloat);
    const auto counted = targets.ne(ignore);
    // `kept`: each row's log-sum-exp, or with one block every column's
    // log-probability; `capped`: with one block, the soft cap's tanh.
    at::Tensor loss, kept, capped, grad_h;
    const bool whole = block >= vocab;
    ahead = ahead && !whole;
    if (whole) {
      // One block holds every column: libtorch's log-softmax and NLL on
      // the whole rows, as the unfused loss runs them, and what their
      // backward reads kept, as the unfused loss keeps it.
      kept = at::log_softmax(logits_of(h, w, b, post, &capped).to(fp), 1);
      loss = at::nll_loss(kept, targets, {}, at::Reduction::Sum, ignore);
    } else {
      // A block of columns at a time, every row in each: each block's
      // product is as wide in its rows as the unfused one (a block of
      // rows would make thin products, at half their speed on a CPU).
      // Each row's log-sum-exp is kept running: its largest logit so
      // far, and the sum of the exponentials below it.
      auto most = at::full({rows}, -std::numeric_limits<double>::infinity(), h.options().dtype(fp));
      auto sum = at::zeros({rows}, h.options().dtype(fp));
      auto picked = at::zeros({rows}, h.options().dtype(fp));
      // With `ahead`: the sum over blocks of each block's exponentials
      // (below the row's largest logit so far, as `sum`'s) through the
      // steps after the product, times its rows of the matrix; and the
      // soft cap's tanh at each row's target.
      auto spread = ahead ? at::zeros({rows, h.size(1)}, h.options().dtype(fp)) : at::Tensor();
      auto picked_tanh = ahead && post.cap > 0.0 ? at::zeros({rows}, h.options().dtype(fp)) : at::Tensor();
      for (int64_t v = 0; v < vocab; v += block) {
        const int64_t m = std::min(block, vocab - v);
        const auto wv = w.narrow(0, v, m);
        const auto bv = b.defined() ? b.narrow(0, v, m) : at::Tensor();
        // A fresh tensor (the product, or its fp32 copy): the
        // exponentials are taken in place, a pass and a block fewer.
        at::Tensor tanh_z;
        const auto z = logits_of(h, wv, bv, post, ahead ? &tanh_z : nullptr).to(fp);
        // The targets' logits, where they fall in this block, before
        // the exponentials overwrite them.
        const auto local = targets - v;
        const auto here = (counted & local.ge(0) & local.lt(m)).nonzero().squeeze(1);
        if (here.numel() > 0) {
          const auto at_target = local.index_select(0, here);
          picked.index_put_({here}, z.index({here, at_target}));
          if (picked_tanh.defined()) {
            picked_tanh.index_put_({here}, tanh_z.index({here, at_target}).to(fp));
          }
        }
        const auto now = at::maximum(most, std::get<0>(z.max(1)));
        const auto rescale = (most - now).exp_();
        sum = sum * rescale + z.sub_(now.unsqueeze(1)).exp_().sum(1);
        most = now;
        if (ahead) {
          // `z` now holds the exponentials: the softmax's numerators,
          // whose denominator is known only after the last block. The
          // steps after the product are linear in the gradient, so the
          // division can wait; each row's terms so far are rescaled as
          // its largest logit grows, as `sum` is.
          spread.mul_(rescale.unsqueeze(1));
          const auto dlin = before_post(z, tanh_z.defined() ? tanh_z.to(fp) : tanh_z, post);
          spread.addmm_(dlin, wv.to(fp));
        }
      }
      kept = most + sum.log();
      loss = at::where(counted, kept - picked, at::zeros({}, kept.options())).sum();
      if (ahead) {
        // h's gradient for a seed of 1: each counted row's softmax share
        // (`spread` over its `sum`) less its target's row of the matrix
        // through the steps after the product, over the count with
        // `mean`; none for a row not counted.
        grad_h = spread.div_(sum.unsqueeze(1));
        const auto rows_counted = counted.nonzero().squeeze(1);
        if (rows_counted.numel() > 0) {
          const auto ones = at::ones({rows_counted.numel()}, h.options().dtype(fp));
          const auto t_at = picked_tanh.defined() ? picked_tanh.index_select(0, rows_counted) : picked_tanh;
          const auto factor = before_post(ones, t_at, post);
          const auto w_at = w.index_select(0, targets.index_select(0, rows_counted)).to(fp);
          grad_h.index_add_(0, rows_counted, w_at.mul_(factor.unsqueeze(1)), -1);
        }
      }
    }
    auto count = counted.sum().to(fp);
    if (mean) {
      loss = loss / count;
    }
    ctx->saved_data["ahead"] = ahead;
    if (ahead) {
      ctx->saved_data["dtype"] = h.scalar_type();
      const auto row_seed = mean ? counted.to(fp) / count : counted.to(fp);
      ctx->save_for_backward({grad_h.mul_(row_seed.unsqueeze(1))});
      return {loss};
    }
    ctx->save_for_backward({h, w, b, targets, kept, count, capped});
    ctx->saved_data["whole"] = whole;
    ctx->saved_data["logits"] = logits;
    ctx->saved_data["ignore"] = ignore;
    ctx->saved_data["mean"] = mean;
    ctx->saved_data["bias_after"] = bias_after;
    ctx->saved_data["divide"] = divide;
    ctx->saved_data["multiply"] = multiply;
    ctx->saved_data["cap"] = cap;
    return {loss};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    if (ctx->saved_data["ahead"].toBool()) {
      // Forward computed h's gradient for a seed of 1, in fp32: scaled
      // by the seed, rounded once to h's dtype. Nothing else needs one.
      if (!ctx->needs_input_grad(0)) {
        return gradients({}, {}, {});
      }
      const auto &grad_h = saved[0];
      return gradients((grad_h * grads[0].to(grad_h.scalar_type())).to(ctx->saved_data["dtype"].toScalarType()),
                       {}, {});
    }
    const auto &h = saved[0], &w = saved[1], &b = saved[2], &targets = saved[3], &kept = saved[4],
               &count = saved[5], &capped = saved[6];
    const int64_t ignore = ctx->saved_data["ignore"].toInt();
    const Post post{ctx->saved_data["bias_after"].toBool(), ctx->saved_data["divide"].toDouble(),
                    ctx->saved_data["multiply"].toDouble(), ctx->saved_data["cap"].toDouble()};
    const bool need_h = ctx->needs_input_grad(0), need_w = ctx->needs_input_grad(1),
               need_b = b.defined() && ctx->needs_input_grad(2);
    const int64_t vocab = w.size(0), block = block_of(ctx->saved_data["logits"].toInt(), h.size(0));
    const auto fp = at::promote_types(h.scalar_type(), at::kFloat);
    auto seed = grads[0].to(fp);
    if (ctx->saved_data["mean"].toBool()) {
      seed = seed / count;
    }
    // The bias's gradient sums the rows.
    const std::vector<int64_t> over_rows{0};
    if (ctx->saved_data["whole"].toBool()) {
      // One block held every column: the unfused loss's and head's own
      // kernels on the log-probabilities forward kept, so that their
      // gradients are the same bits (a small vocabulary, or few tokens).
      // The NLL's gradient is freed before the products, as autograd
      // frees it between the unfused loss's nodes.
      const auto dz = [&] {
        const auto dlogp = at::nll_loss_backward(seed, kept, targets, {}, at::Reduction::Sum, ignore, count);
        return at::_log_softmax_backward_data(dlogp, kept, 1, fp).to(h.scalar_type());
      }();
      const auto dlin = before_post(dz, capped, post);
      return gradients(need_h ? at::mm(dlin, w) : at::Tensor(), need_w ? at::mm(dlin.t(), h) : at::Tensor(),
                       need_b ? dlin.sum(over_rows) : at::Tensor());
    }
    // Each row's share of the seed: none for a row not counted.
    const auto counted = targets.ne(ignore);
    const auto row_seed = counted.to(fp) * seed;
    auto grad_h = need_h ? at::zeros({h.size(0), h.size(1)}, h.options().dtype(fp)) : at::Tensor();
    auto grad_w = need_w ? at::empty_like(w, at::MemoryFormat::Contiguous) : at::Tensor();
    auto grad_b = need_b ? at::empty_like(b, at::MemoryFormat::Contiguous) : at::Tensor();
    for (int64_t v = 0; v < vocab; v += block) {
      const int64_t m = std::min(block, vocab - v);
      const auto wv = w.narrow(0, v, m);
      const auto bv = b.defined() ? b.narrow(0, v, m) : at::Tensor();
      at::Tensor tanh_z;
      const auto z = logits_of(h, wv, bv, post, &tanh_z);
      // The cross-entropy's gradient at these columns: the softmax times
      // each row's seed, less the seed at the row's target.
      // In place on `z` or its fp32 copy: nothing else reads it.
      auto dz = z.to(fp).sub_(kept.unsqueeze(1)).exp_().mul_(row_seed.unsqueeze(1));
      const auto local = targets - v;
      const auto here = (counted & local.ge(0) & local.lt(m)).nonzero().squeeze(1);
      if (here.numel() > 0) {
        dz.index_put_({here, local.index_select(0, here)}, -row_seed.index_select(0, here), true);
      }
      const auto dlin = before_post(dz.to(z.scalar_type()), tanh_z, post);
      if (need_w) {
        grad_w.narrow(0, v, m).copy_(at::mm(dlin.t(), h));
      }
      if (need_b) {
        grad_b.narrow(0, v, m).copy_(dlin.sum(over_rows));
      }
      if (need_h) {
        // In fp32 whatever the dtype: each block's product rounded to
        // bf16 before the sum ran 2.5x as fast on a CPU with bf16
        // products, but its rounding of shares that cancel put h's
        // gradient 4-8x further from the unfused one's (to 7.6e-3 of its
        // largest value, at two blocks).
        grad_h.addmm_(dlin.to(fp), wv.to(fp));
      }
    }
    if (need_h) {
      grad_h = grad_h.to(h.scalar_type());
    }
    return gradients(grad_h, grad_w, grad_b);
  }
};

}  // namespace

extern "C" {

// `LinearCrossEntropy` (see there) into `*out`; `b` null for no bias.
char *zrt_linear_cross_entropy(const at::Tensor *h, const at::Tensor *w, const at::Tensor *b,
                               const at::Tensor *targets, int64_t ignore, int mean, int bias_after, double divide,
                               double multiply, double cap, int64_t block_logits, at::Tensor **out) {
  try {
    if (h->dim() != 2 || w->dim() != 2 || h->size(1) != w->size(1)) {
      return linear_loss_error("linear_cross_entropy takes hidden states [rows, width] and a matrix [vocab, width]");
    }
    if (targets->dim() != 1 || targets->size(0) != h->size(0) || targets->scalar_type() != at::kLong) {
      return linear_loss_error("linear_cross_entropy takes int64 targets [rows], one a row of hidden states");
    }
    if (h->scalar_type() != w->scalar_type()) {
      return linear_loss_error("linear_cross_entropy takes hidden states and a matrix of one dtype");
    }
    const auto outside = targets->ne(ignore) & (targets->lt(0) | targets->ge(w->size(0)));
    if (outside.any().item<bool>()) {
      return linear_loss_error("linear_cross_entropy: a target is outside the vocabulary of " +
                               std::to_string(w->size(0)) + " words (and not " + std::to_string(ignore) + ")");
    }
    const auto bias = b == nullptr ? std::optional<at::Tensor>() : std::optional<at::Tensor>(*b);
    if (bias && (bias->dim() != 1 || bias->size(0) != w->size(0))) {
      return linear_loss_error("linear_cross_entropy takes a bias [vocab]");
    }
    // Only h needs a gradient (a frozen head, under LoRA): forward may
    // compute it as it goes.
    const bool ahead = at::GradMode::is_enabled() && h->requires_grad() && !w->requires_grad() &&
                       !(bias && bias->requires_grad());
    auto ys = LinearCrossEntropy::apply(*h, *w, bias, *targets, ignore, mean != 0, bias_after != 0, divide,
                                        multiply, cap, block_logits, ahead);
    *out = new at::Tensor(ys.at(0));
    return nullptr;
  } catch (const std::exception &e) {
    return linear_loss_error(e.what());
  }
}

}  // extern "C"
