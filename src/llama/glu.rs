//! The gated MLPs' product, `act(gate) * up`, keeping less for backward.
//!
//! Computed plainly, autograd keeps three tensors as wide as the MLP: the
//! activation's input (`gate`), its output (for `up`'s gradient) and
//! `up` (for the activation's). The activation's output is cheap to
//! compute again, so when both factors need a gradient the product runs
//! under [`glue::checkpoint_without_draws`]: it keeps `gate` and `up`
//! alone, and backward computes the activation again from `gate` (as
//! Liger's SwiGLU kernel does). That is b i bytes a token and layer less
//! (a quarter of a gated MLP's activations), for one more activation in
//! backward; the values and gradients are the plain product's, to the
//! bit (the same operations on the same tensors).
//!
//! GPT-OSS's experts' activation goes the same way from their biased
//! gate-and-up product ([`clamped`]), keeping that product alone where
//! its clamps, sigmoid and factors kept four more tensors as wide; and
//! `gelu_new` ([`gelu_new`]), written out in five operations as
//! `transformers` writes it, keeps its input alone where those kept
//! four tensors as wide.

use tch::Tensor;

use crate::zero::glue;

use super::config::Activation;

/// `act(gate) * up`, keeping `gate` and `up` alone for backward when both
/// need a gradient (when one does not, the plain product keeps no more).
pub(super) fn gated(act: Activation, gate: &Tensor, up: &Tensor) -> Tensor {
    let plain = move |gate: &Tensor, up: &Tensor| act.apply(gate) * up;
    if !(gate.requires_grad() && up.requires_grad()) {
        return plain(gate, up);
    }
    glue::checkpoint_without_draws(&[gate, up], move |x| Ok(plain(&x[0], &x[1]))).unwrap_or_else(
        |e| {
            tracing::warn!("{e}: the gated product keeps its activation's output");
            plain(gate, up)
        },
    )
}

/// GPT-OSS's clamp on its experts' gate.
const OSS_LIMIT: f64 = 7.0;
/// GPT-OSS's factor inside its gate's sigmoid.
const OSS_ALPHA: f64 = 1.702;

/// GPT-OSS's experts' activation (`GptOssExperts`'s) of their biased
/// gate-and-up product `gate_up` `[n, 2 width]`, each expert's gate and
/// up columns interleaved: `(up + 1) * gate * sigmoid(1.702 gate)`, the
/// gate clamped below 7 and `up` within ±7. Keeps `gate_up` alone for
/// backward when it needs a gradient.
pub(super) fn clamped(gate_up: &Tensor) -> Tensor {
    input_alone(
        gate_up,
        clamped_plainly,
        "GPT-OSS's activation keeps its clamps and factors",
    )
}

/// `gelu_new` as `NewGELUActivation` computes it, `0.5 x (1 +
/// tanh(sqrt(2 / pi) (x + 0.044715 x^3)))`, operation by operation (its
/// bits, not libtorch's fused tanh GELU's), keeping `x` alone for
/// backward when it needs a gradient: plainly, the tanh's output, its
/// sum with 1 and half of `x` were kept beside `x`.
pub(super) fn gelu_new(x: &Tensor) -> Tensor {
    input_alone(
        x,
        gelu_new_plainly,
        "gelu_new keeps its intermediate values",
    )
}

/// `f(x)`, keeping `x` alone for backward when it needs a gradient, `f`
/// computed again there (it must draw no random numbers); `f` plainly,
/// `what` logged, should the checkpoint fail.
fn input_alone(x: &Tensor, f: fn(&Tensor) -> Tensor, what: &str) -> Tensor {
    if !x.requires_grad() {
        return f(x);
    }
    glue::checkpoint_without_draws(&[x], move |x| Ok(f(&x[0]))).unwrap_or_else(|e| {
        tracing::warn!("{e}: {what}");
        f(x)
    })
}

/// [`gelu_new`], keeping what autograd keeps.
fn gelu_new_plainly(x: &Tensor) -> Tensor {
    let inner = (x + x.pow_tensor_scalar(3.0) * 0.044715) * (2.0 / std::f64::consts::PI).sqrt();
    (x * 0.5) * (inner.tanh() + 1.0)
}

/// [`clamped`], operation by operation as `transformers` computes it.
fn clamped_plainly(gate_up: &Tensor) -> Tensor {
    let gate = gate_up.slice(-1, 0, None, 2).clamp_max(OSS_LIMIT);
    let up = gate_up.slice(-1, 1, None, 2).clamp(-OSS_LIMIT, OSS_LIMIT);
    let glu = &gate * (&gate * OSS_ALPHA).sigmoid();
    (up + 1.0) * glu
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    /// The gradients of `Σ seed * f(xs)` in `xs`, and `f`'s output.
    fn run(f: impl Fn(&[Tensor]) -> Tensor, xs: &[Tensor], seed: &Tensor) -> (Tensor, Vec<Tensor>) {
        let out = f(xs);
        let loss = (&out * seed).sum(Kind::Float);
        let wrt: Vec<&Tensor> = xs.iter().collect();
        (
            out.detach(),
            Tensor::run_backward(&[loss], &wrt, false, false),
        )
    }

    #[test]
    fn the_recomputed_products_are_the_plain_ones_to_the_bit() {
        tch::manual_seed(5);
        let opts = (Kind::Float, Device::Cpu);
        // Wide enough that the up half's clamp binds somewhere.
        let x = || (Tensor::randn([6, 40], opts) * 4.0).set_requires_grad(true);
        let seed = Tensor::randn([6, 40], opts);
        for act in [Activation::Silu, Activation::GeluTanh, Activation::Relu2] {
            let xs = [x(), x()];
            let plain = |x: &[Tensor]| act.apply(&x[0]) * &x[1];
            let (want, wg) = run(plain, &xs, &seed);
            let (got, gg) = run(|x| gated(act, &x[0], &x[1]), &xs, &seed);
            assert!(got.equal(&want), "{act:?}");
            for (a, b) in wg.iter().zip(&gg) {
                assert!(a.equal(b), "{act:?}");
            }
        }
        let xs = [x()];
        let half = Tensor::randn([6, 20], opts);
        let (want, wg) = run(|x| clamped_plainly(&x[0]), &xs, &half);
        let (got, gg) = run(|x| clamped(&x[0]), &xs, &half);
        assert!(got.equal(&want));
        assert!(wg[0].equal(&gg[0]));
        // The clamps bind: some of the gradient is zero.
        assert!(gg[0].eq(0.0).any().int64_value(&[]) == 1); // gelu_new, in fp32 and bf16.
        for kind in [Kind::Float, Kind::BFloat16] {
            let xs = [x().detach().to_kind(kind).set_requires_grad(true)];
            let seed = seed.to_kind(kind);
            let (want, wg) = run(|x| gelu_new_plainly(&x[0]), &xs, &seed);
            let (got, gg) = run(|x| gelu_new(&x[0]), &xs, &seed);
            assert!(got.equal(&want) && wg[0].equal(&gg[0]), "{kind:?}");
        }
    }
}
