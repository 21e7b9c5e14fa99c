//! Apertus's activation, xIELU (Huang et al., 2024), with the trained
//! parameters its MLP holds (`mlp.act_fn.alpha_p`, `alpha_n`, and the
//! frozen `beta` and `eps`), as `transformers`' `XIELUActivation`
//! computes it in Python:
//! `x > 0 ? a_p x^2 + b x : (expm1(min(x, eps)) - x) a_n + b x`, with
//! `a_p = softplus(alpha_p)` and `a_n = b + softplus(alpha_n)`.
//!
//! Computed plainly, autograd keeps four tensors as wide as the MLP and
//! a mask: its input, `a_p x`, `expm1(min(x, eps))`, `expm1(..) - x` and
//! which side each value took, 4 b + 1 bytes an element (b the dtype's)
//! where `transformers`' Python class keeps the same. zrt runs it under
//! [`glue::checkpoint_without_draws`]: it keeps its input and its two
//! factors alone, and backward computes it again (as [`super::glu`]
//! does for the gated MLPs), b bytes an element, for one more xIELU in
//! backward; the values and gradients are the plain computation's, to
//! the bit (the same operations on the same tensors).

use tch::{nn, Tensor};

use crate::zero::glue;

/// The class's initial `alpha_p`, `alpha_n`, `beta` and `eps`.
pub(super) const INITIAL: (f64, f64, f64, f64) = (0.8, 0.8, 0.5, -1e-6);

/// An MLP's xIELU: two trained scalars (`[1]` each) and two frozen
/// ones (0-dimensional), as the checkpoint holds them.
#[derive(Debug)]
pub(super) struct Xielu {
    alpha_p: Tensor,
    alpha_n: Tensor,
    beta: Tensor,
    eps: Tensor,
}

/// `log(expm1(v))`: the parameter whose softplus is `v`.
fn inverse_softplus(v: f64) -> f64 {
    v.exp_m1().ln()
}

impl Xielu {
    /// Under `p` (`mlp.act_fn`), at the class's initial values (a
    /// checkpoint's replace them).
    pub(super) fn new(p: &nn::Path) -> Self {
        let (ap, an, beta, eps) = INITIAL;
        let frozen = |name: &str, v: f64| {
            let t = p.zeros_no_train(name, &[]);
            tch::no_grad(|| t.shallow_clone().fill_(v))
        };
        Self {
            alpha_p: p.var("alpha_p", &[1], nn::Init::Const(inverse_softplus(ap))),
            alpha_n: p.var(
                "alpha_n",
                &[1],
                nn::Init::Const(inverse_softplus(an - beta)),
            ),
            beta: frozen("beta", beta),
            eps: frozen("eps", eps),
        }
    }

    /// xIELU of `x`, in its dtype, keeping `x` and its factors alone for
    /// backward.
    pub(super) fn forward(&self, x: &Tensor) -> Tensor {
        let k = x.kind();
        let a_p = self.alpha_p.softplus().to_kind(k);
        let a_n = (&self.beta + self.alpha_n.softplus()).to_kind(k);
        let (beta, eps) = (self.beta.to_kind(k), self.eps.to_kind(k));
        let plain = |t: &[Tensor]| xielu(&t[0], (&t[1], &t[2]), (&t[3], &t[4]));
        let inputs = [x, &a_p, &a_n, &beta, &eps];
        if !inputs.iter().any(|t| t.requires_grad()) {
            return xielu(x, (&a_p, &a_n), (&beta, &eps));
        }
        glue::checkpoint_without_draws(&inputs, move |t| Ok(plain(t))).unwrap_or_else(|e| {
            tracing::warn!("{e}: xIELU keeps its intermediate values");
            xielu(x, (&a_p, &a_n), (&beta, &eps))
        })
    }
}

/// `x > 0 ? a_p x^2 + b x : (expm1(min(x, eps)) - x) a_n + b x`, in the
/// operations' order of `transformers`' Python xIELU.
fn xielu(x: &Tensor, (a_p, a_n): (&Tensor, &Tensor), (beta, eps): (&Tensor, &Tensor)) -> Tensor {
    let positive = a_p * x * x + beta * x;
    let negative = (x.minimum(eps).expm1() - x) * a_n + beta * x;
    positive.where_self(&x.gt(0.0), &negative)
}

/// xIELU at the class's initial parameters: what [`Activation::Xielu`]
/// computes where no trained ones are held.
///
/// [`Activation::Xielu`]: super::config::Activation::Xielu
pub(super) fn initial(x: &Tensor) -> Tensor {
    let (ap, an, beta, eps) = INITIAL;
    let scalar = |v: f64| Tensor::from(v).to_kind(x.kind()).to_device(x.device());
    xielu(x, (&scalar(ap), &scalar(an)), (&scalar(beta), &scalar(eps)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    #[test]
    fn the_recomputed_xielu_is_the_plain_one_to_the_bit() {
        tch::manual_seed(7);
        let vs = nn::VarStore::new(Device::Cpu);
        let act = Xielu::new(&vs.root());
        for kind in [Kind::Float, Kind::BFloat16] {
            // Both sides of 0, and values below `eps` near it.
            let x = (Tensor::randn([6, 40], (Kind::Float, Device::Cpu)) * 3.0)
                .to_kind(kind)
                .set_requires_grad(true);
            let seed = Tensor::randn([6, 40], (Kind::Float, Device::Cpu));
            let wrt = [&x, &act.alpha_p, &act.alpha_n];
            let run = |out: Tensor| {
                let loss = (&out.to_kind(Kind::Float) * &seed).sum(Kind::Float);
                (
                    out.detach(),
                    Tensor::run_backward(&[loss], &wrt, false, false),
                )
            };
            let plain = {
                let k = kind;
                let a_p = act.alpha_p.softplus().to_kind(k);
                let a_n = (&act.beta + act.alpha_n.softplus()).to_kind(k);
                xielu(
                    &x,
                    (&a_p, &a_n),
                    (&act.beta.to_kind(k), &act.eps.to_kind(k)),
                )
            };
            let (want, wg) = run(plain);
            let (got, gg) = run(act.forward(&x));
            assert!(got.equal(&want), "{kind:?}");
            for (a, b) in wg.iter().zip(&gg) {
                assert!(a.equal(b), "{kind:?}");
            }
            // Both sides ran, and the factors had gradients.
            assert!(gg[1].abs().double_value(&[0]) > 0.0 && gg[2].abs().double_value(&[0]) > 0.0);
        }
    }
}
