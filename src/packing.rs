//! Documents packed into one row, each attending only within itself.
//!
//! Fine-tuning data is packed: documents one after the other, separated
//! by an end-of-sequence token, cut into windows of the sequence length.
//! A plain causal forward lets each token attend to every earlier token
//! of its window, the end of an unrelated document too. `transformers`
//! has a format for rows of several documents (what TRL's
//! `padding_free` and `DataCollatorWithFlattening` give): `position_ids`
//! that restart at each document's first token and no attention mask.
//! Its models then build a block-diagonal causal mask (a new document
//! wherever a position is not one more than the one before it) and turn
//! each token's queries and keys at its position in its own document.
//! [`HfModel::forward_packed`](crate::hf::HfModel::forward_packed) does
//! the same, and
//! [`HfModel::loss_packed`](crate::hf::HfModel::loss_packed) leaves out
//! the prediction of each document's first token from the document before
//! (the label `DataCollatorWithFlattening` sets to -100).
//!
//! [`document_positions`] makes such positions from the tokens and the
//! model's end-of-sequence ids: a document ends with its end token, the
//! next begins after it. That suits text; a conversation ends each turn
//! with the token that ends it, so [`positions_from_starts`] makes them
//! from where each document starts instead, as `zrt tokenize
//! --document-starts` writes it beside the ids.

use std::sync::Arc;

use parking_lot::Mutex;
use tch::{Device, Kind, Tensor};

use crate::hf::HfError;

/// Positions `[batch, seq]` (int64) of `tokens` `[batch, seq]` counted
/// from each document's first token: 0 at the start of the row and after
/// every token in `eos`, one more at every other token. A window that
/// begins inside a document counts that document from the window's
/// start (its earlier tokens are not in the row).
pub fn document_positions(tokens: &Tensor, eos: &[i64]) -> Tensor {
    let (b, t) = tokens.size2().unwrap_or((1, tokens.numel() as i64));
    let tokens = tokens.view([b, t]);
    if t == 0 {
        return tokens.zeros_like();
    }
    let mut ends = tokens.zeros_like().to_kind(Kind::Bool);
    for &id in eos {
        ends = ends.logical_or(&tokens.eq(id));
    }
    // A document starts after each end token.
    let starts = Tensor::cat(
        &[
            ends.narrow(1, t - 1, 1).zeros_like(),
            ends.narrow(1, 0, t - 1),
        ],
        1,
    );
    positions_from_starts(&starts)
}

/// Positions `[batch, seq]` (int64) counted from each document's first
/// token, where `starts` (`[batch, seq]`, nonzero at a document's first
/// token: `zrt tokenize --document-starts` writes them a byte a token)
/// marks them; the row's first token starts one whatever it says.
pub fn positions_from_starts(starts: &Tensor) -> Tensor {
    let (b, t) = starts.size2().unwrap_or((1, starts.numel() as i64));
    let starts = starts.view([b, t]).ne(0);
    if t == 0 {
        return starts.to_kind(Kind::Int64);
    }
    let opts = (Kind::Int64, starts.device());
    let column = Tensor::arange(t, opts).unsqueeze(0).expand([b, t], false);
    // Each token's document starts at the last start at or before it.
    let start_at = column.where_self(&starts, &column.zeros_like());
    let (first, _) = start_at.cummax(1);
    column - first
}

/// Where `positions` (`[batch, seq]`) start a document after another one,
/// by `transformers`' rule: a position not one more than the one before
/// it. Bool, `[batch, seq]`; the row's first token is not marked (it
/// follows no document of its row).
pub fn document_starts(positions: &Tensor) -> Tensor {
    let t = positions.size().last().copied().unwrap_or(0);
    let first = positions.narrow(-1, 0, 1).zeros_like().to_kind(Kind::Bool);
    if t < 2 {
        return first;
    }
    let step = positions.narrow(-1, 1, t - 1) - positions.narrow(-1, 0, t - 1);
    Tensor::cat(&[first, step.ne(1)], -1)
}

/// One forward's packed documents, as every attention layer reads them:
/// each token's position in its document and which keys each query sees.
#[derive(Debug)]
pub(crate) struct Documents {
    /// `[batch, seq]`, int64.
    pub(crate) positions: Tensor,
    /// `[batch, seq]`, int64: each token's document, numbered along its row.
    doc: Tensor,
    /// [`Documents::visible`], once a layer asked for it (most never do,
    /// and it is `seq` times the size of the tokens), shared by them all.
    visible: Arc<Mutex<Option<Tensor>>>,
    /// Each row's documents' lengths, in order (their sum is `seq`).
    lengths: Arc<Vec<Vec<i64>>>,
    /// The largest position plus one: the length a rotary embedding whose
    /// frequencies depend on it (`dynamic`, LongRoPE) takes, as
    /// `transformers` takes `max(position_ids) + 1`.
    pub(crate) longest: i64,
}

impl Documents {
    /// The documents `positions` describe for `tokens`: both `[batch,
    /// seq]`, positions int64 and not negative.
    pub(crate) fn new(tokens: &Tensor, positions: &Tensor) -> Result<Self, HfError> {
        let bad = |why: String| Err(HfError::Packed(why));
        if positions.kind() != Kind::Int64 {
            return bad(format!(
                "positions are {:?}: give int64 (`document_positions` makes them)",
                positions.kind()
            ));
        }
        if positions.size() != tokens.size() || tokens.dim() != 2 {
            return bad(format!(
                "positions {:?} for tokens {:?}: give one position a token, both [batch, seq]",
                positions.size(),
                tokens.size()
            ));
        }
        if positions.numel() == 0 {
            return bad("no tokens".into());
        }
        let least = positions.min().int64_value(&[]);
        if least < 0 {
            return bad(format!(
                "a position is {least}: positions count from 0 at each document's start"
            ));
        }
        let longest = positions.max().int64_value(&[]) + 1;
        let starts = document_starts(positions).to_kind(Kind::Int64);
        let t = positions.size()[1];
        let marks = Vec::<i64>::try_from(starts.to_device(Device::Cpu).flatten(0, -1))
            .map_err(|e| HfError::Packed(format!("cannot read the positions: {e}")))?;
        let lengths = marks
            .chunks(t as usize)
            .map(|row| {
                // A document ends where the next starts, the last at the row's end.
                let ends = (1..t).filter(|&i| row[i as usize] != 0).chain([t]);
                let mut from = 0;
                ends.map(|end| end - std::mem::replace(&mut from, end))
                    .collect()
            })
            .collect::<Vec<_>>();
        Ok(Self {
            positions: positions.shallow_clone(),
            doc: starts.cumsum(-1, Kind::Int64),
            visible: Arc::default(),
            lengths: Arc::new(lengths),
            longest,
        })
    }

    /// `scan` run on each document of each row alone, its outputs put
    /// back in place: `inputs` are `[batch, seq, ...]`, and `scan` gets
    /// one document's slice of each, `[1, length, ...]`, and returns its
    /// `[1, length, ...]`. A recurrent layer (a Mamba's scan) reads a
    /// packed row so, each document from a zero state, as it would read
    /// the document alone.
    pub(crate) fn each_alone(
        &self,
        inputs: &[&Tensor],
        mut scan: impl FnMut(&[Tensor]) -> Tensor,
    ) -> Tensor {
        let rows: Vec<Tensor> = (self.lengths.iter().enumerate())
            .map(|(r, lengths)| {
                let split: Vec<Vec<Tensor>> = (inputs.iter())
                    .map(|x| x.narrow(0, r as i64, 1).split_with_sizes(lengths, 1))
                    .collect();
                let parts: Vec<Tensor> = (0..lengths.len())
                    .map(|i| {
                        let one: Vec<Tensor> = split.iter().map(|s| s[i].shallow_clone()).collect();
                        scan(&one)
                    })
                    .collect();
                Tensor::cat(&parts, 1)
            })
            .collect();
        Tensor::cat(&rows, 0)
    }

    /// The same tensors, shared.
    pub(crate) fn shared(&self) -> Self {
        Self {
            positions: self.positions.shallow_clone(),
            doc: self.doc.shallow_clone(),
            visible: self.visible.clone(),
            lengths: self.lengths.clone(),
            longest: self.longest,
        }
    }

    /// `[batch, 1, seq, seq]`, bool: key `j` is in query `i`'s document
    /// and not after it (the block-diagonal causal mask).
    pub(crate) fn visible(&self) -> Tensor {
        let mut kept = self.visible.lock();
        let mask = kept.get_or_insert_with(|| {
            let t = self.doc.size()[1];
            let causal = in_window(t, t, self.doc.device());
            let same = self.doc.unsqueeze(2).eq_tensor(&self.doc.unsqueeze(1));
            same.logical_and(&causal).unsqueeze(1)
        });
        mask.shallow_clone()
    }

    /// [`Documents::visible`] within `window` (each query sees itself and
    /// the `w - 1` keys before it) when one is given.
    pub(crate) fn visible_within(&self, window: Option<i64>) -> Tensor {
        let t = self.doc.size()[1];
        match window.filter(|&w| w < t) {
            Some(w) => self
                .visible()
                .logical_and(&in_window(t, w, self.doc.device())),
            None => self.visible(),
        }
    }

    /// Attention of `q` over `k` and `v` (`[batch, heads, seq, hd]`; with
    /// `grouped`, fewer key-value heads) where each query sees its own
    /// document up to itself, and within `window` (the query and the
    /// `w - 1` tokens before it) when one is given. `scale` as
    /// libtorch's fused kernel takes it (`None`: one over the root of
    /// `hd`).
    ///
    /// Without dropout each document is its own causal attention: one
    /// fused call per document (per row, unless every row is cut alike),
    /// each over its own keys, as `transformers`' flash-attention path
    /// runs packed rows (its `varlen` kernel). The same outputs as the
    /// block-diagonal mask, but libtorch's kernels given a mask visit
    /// every block of it: forward and backward of 2 x 8 heads x 2048
    /// tokens x 64 took 3 to 17 times as long with it for documents of
    /// 1024 down to 64 tokens, twice for one of 2048
    /// (`bench/peers/packed_attention.py`). With dropout, one call over
    /// the mask: the weights dropped are then the ones `transformers`
    /// drops from the same seed.
    pub(crate) fn attend(
        &self,
        (q, k, v): (&Tensor, &Tensor, &Tensor),
        window: Option<i64>,
        scale: Option<f64>,
        dropout: f64,
        grouped: bool,
    ) -> Tensor {
        let sdpa = Tensor::scaled_dot_product_attention::<Tensor>;
        if dropout > 0.0 {
            let mask = self.visible_within(window);
            return sdpa(q, k, v, Some(mask), dropout, false, scale, grouped);
        }
        // One document: causal, or causal within the window.
        self.per_document((q, k, v), |q, k, v, n| {
            let mask = window
                .filter(|&w| w < n)
                .map(|w| in_window(n, w, q.device()));
            let causal = mask.is_none();
            sdpa(q, k, v, mask, 0.0, causal, scale, grouped)
        })
    }

    /// `one(q, k, v, n)` on each document's queries, keys and values
    /// (`[batch, heads, seq, hd]` cut along `seq`: `[1 or batch, heads,
    /// n, hd]`), the outputs (of the queries' shape) joined again along
    /// `seq` and the rows: a call per document, per row unless every row
    /// is cut alike.
    pub(crate) fn per_document(
        &self,
        (q, k, v): (&Tensor, &Tensor, &Tensor),
        one: impl Fn(&Tensor, &Tensor, &Tensor, i64) -> Tensor,
    ) -> Tensor {
        // One row's documents (or every row's, cut alike), joined again.
        let row = |q: &Tensor, k: &Tensor, v: &Tensor, lengths: &[i64]| {
            if let [n] = lengths {
                return one(q, k, v, *n);
            }
            let (qs, ks, vs) = (
                q.split_with_sizes(lengths, 2),
                k.split_with_sizes(lengths, 2),
                v.split_with_sizes(lengths, 2),
            );
            let parts: Vec<Tensor> = (qs.iter().zip(&ks).zip(&vs).zip(lengths))
                .map(|(((q, k), v), &n)| one(q, k, v, n))
                .collect();
            Tensor::cat(&parts, 2)
        };
        let lengths = self.lengths.as_slice();
        if let [first, rest @ ..] = lengths {
            if rest.iter().all(|l| l == first) {
                return row(q, k, v, first);
            }
        }
        let (qs, ks, vs) = (q.split(1, 0), k.split(1, 0), v.split(1, 0));
        let rows: Vec<Tensor> = (qs.iter().zip(&ks).zip(&vs).zip(lengths))
            .map(|(((q, k), v), l)| row(q, k, v, l))
            .collect();
        Tensor::cat(&rows, 0)
    }
}

/// `[t, t]` bool: key `j` is query `i`'s or one of the `w - 1` before it
/// (causal when `w >= t`).
pub(crate) fn in_window(t: i64, w: i64, device: Device) -> Tensor {
    in_window_from((0, t), t, w, device)
}

/// [`in_window`] of `n` queries at positions `first..first + n` over
/// `keys` keys from position 0 (a generation's cache, or a block of the
/// queries): `[n, keys]` bool.
pub(crate) fn in_window_from((first, n): (i64, i64), keys: i64, w: i64, device: Device) -> Tensor {
    let opts = (Kind::Int64, device);
    let back = Tensor::arange_start(first, first + n, opts).unsqueeze(1)
        - Tensor::arange(keys, opts).unsqueeze(0);
    back.ge(0).logical_and(&back.lt(w))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ints(t: &Tensor) -> Vec<i64> {
        Vec::try_from(t.to_kind(Kind::Int64).flatten(0, -1)).unwrap()
    }

    #[test]
    fn positions_restart_after_each_end_token() {
        let tokens = Tensor::from_slice(&[5i64, 6, 2, 7, 8, 9, 2, 2, 4, 0, 3, 3]).view([2, 6]);
        let p = document_positions(&tokens, &[2, 0]);
        // The second row: two end tokens are two documents of one token.
        assert_eq!(ints(&p), [0, 1, 2, 0, 1, 2, 0, 0, 0, 1, 0, 1]);
        // The same from the documents' first tokens, the row's first
        // one whatever it says.
        let starts = Tensor::from_slice(&[0u8, 0, 0, 1, 0, 0, 1, 1, 1, 0, 1, 0]).view([2, 6]);
        assert_eq!(ints(&positions_from_starts(&starts)), ints(&p));
        // No end token: the row is one document.
        assert_eq!(
            ints(&document_positions(&tokens, &[])),
            [0, 1, 2, 3, 4, 5].repeat(2)
        );
        // transformers' rule finds the same starts, not the row's first.
        assert_eq!(
            ints(&document_starts(&p)),
            [0, 0, 0, 1, 0, 0, 0, 1, 1, 0, 1, 0]
        );
    }

    #[test]
    fn a_query_sees_its_own_document_up_to_itself() {
        let tokens = Tensor::zeros([1, 5], (Kind::Int64, tch::Device::Cpu));
        let p = Tensor::from_slice(&[0i64, 1, 0, 1, 2]).view([1, 5]);
        let d = Documents::new(&tokens, &p).unwrap();
        assert_eq!(d.longest, 3);
        #[rustfmt::skip]
        let want = [
            1, 0, 0, 0, 0,
            1, 1, 0, 0, 0,
            0, 0, 1, 0, 0,
            0, 0, 1, 1, 0,
            0, 0, 1, 1, 1,
        ];
        assert_eq!(ints(&d.visible()), want);
        // A document of one token: a repeated position starts another.
        let p = Tensor::from_slice(&[0i64, 0, 1, 0, 0]).view([1, 5]);
        let d = Documents::new(&tokens, &p).unwrap();
        assert_eq!(ints(&d.visible().diagonal(0, 2, 3)), [1; 5]);
        assert_eq!(ints(&d.visible().sum(Kind::Int64)), [6]);
    }

    #[test]
    fn each_documents_own_attention_is_the_masks_forward_and_backward() {
        tch::manual_seed(0);
        let opts = (Kind::Float, Device::Cpu);
        // Rows cut differently (one call a document a row), then alike
        // (one call a document for both).
        let cuts = [
            (
                [0i64, 1, 2, 0, 1, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1, 2],
                [3, 2, 4, 6, 3],
            ),
            (
                [0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2, 3, 4],
                [4, 5, 4, 5, 0],
            ),
        ];
        for (positions, lengths) in cuts {
            let p = Tensor::from_slice(&positions).view([2, 9]);
            let d = Documents::new(&p.zeros_like(), &p).unwrap();
            let flat: Vec<i64> = d.lengths.iter().flatten().copied().collect();
            assert_eq!(
                flat,
                lengths.into_iter().filter(|&n| n > 0).collect::<Vec<_>>()
            );
            // Grouped heads (4 query heads, 2 key-value), a window
            // shorter than some documents, a scale of its own.
            for (window, scale) in [(None, None), (Some(2), Some(0.3))] {
                let q = Tensor::randn([2, 4, 9, 8], opts).set_requires_grad(true);
                let k = Tensor::randn([2, 2, 9, 8], opts).set_requires_grad(true);
                let v = Tensor::randn([2, 2, 9, 8], opts).set_requires_grad(true);
                let mask = match window {
                    Some(w) => d.visible().logical_and(&in_window(9, w, Device::Cpu)),
                    None => d.visible(),
                };
                let want = Tensor::scaled_dot_product_attention(
                    &q,
                    &k,
                    &v,
                    Some(mask),
                    0.0,
                    false,
                    scale,
                    true,
                );
                let got = d.attend((&q, &k, &v), window, scale, 0.0, true);
                let diff = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]);
                assert!(
                    diff(&got, &want) < 1e-6,
                    "{window:?}: {}",
                    diff(&got, &want)
                );
                let g = want.randn_like();
                let grads = |y: &Tensor| {
                    Tensor::run_backward(&[(y * &g).sum(Kind::Float)], &[&q, &k, &v], false, false)
                };
                for (a, b) in grads(&got).iter().zip(&grads(&want)) {
                    assert!(diff(a, b) < 1e-5, "{window:?}: {}", diff(a, b));
                }
            }
        }
    }

    #[test]
    fn positions_that_do_not_fit_the_tokens_are_refused() {
        let tokens = Tensor::zeros([2, 4], (Kind::Int64, tch::Device::Cpu));
        let err = |p: Tensor| Documents::new(&tokens, &p).unwrap_err().to_string();
        let e = err(Tensor::zeros([2, 3], (Kind::Int64, tch::Device::Cpu)));
        assert!(e.contains("positions [2, 3] for tokens [2, 4]"), "{e}");
        let e = err(Tensor::zeros([2, 4], (Kind::Float, tch::Device::Cpu)));
        assert!(e.contains("positions are Float: give int64"), "{e}");
        let e = err(Tensor::from_slice(&[0i64, 1, -1, 0, 0, 1, 2, 3]).view([2, 4]));
        assert!(e.contains("a position is -1"), "{e}");
    }
}
