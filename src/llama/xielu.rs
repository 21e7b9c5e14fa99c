//! Apertus's activation, xIELU (Huang et al., 2024), with the trained
//! parameters its MLP holds (`mlp.act_fn.alpha_p`, `alpha_n`, and the
//! frozen `beta` and `eps`), as `transformers`' `XIELUActivation`
//! computes it in Python:
//! `x > 0 ? a_p x^2 + b x : (expm1(min(x, eps)) - x) a_n + b x`, with
//! `a_p = softplus(alpha_p)` and `a_n = b + softplus(alpha_n)`.

use tch::{nn, Tensor};

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

    /// xIELU of `x`, in its dtype.
    pub(super) fn forward(&self, x: &Tensor) -> Tensor {
        let k = x.kind();
        let a_p = self.alpha_p.softplus().to_kind(k);
        let a_n = (&self.beta + self.alpha_n.softplus()).to_kind(k);
        xielu(
            x,
            (&a_p, &a_n),
            (&self.beta.to_kind(k), &self.eps.to_kind(k)),
        )
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
