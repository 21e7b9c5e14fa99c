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

use tch::{Kind, Tensor};

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
    /// `[batch, 1, seq, seq]`, bool: key `j` is in query `i`'s document
    /// and not after it.
    pub(crate) visible: Tensor,
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
        // Each token's document, numbered along the row.
        let doc = document_starts(positions)
            .to_kind(Kind::Int64)
            .cumsum(-1, Kind::Int64);
        let t = positions.size()[1];
        let opts = (Kind::Int64, positions.device());
        let causal = Tensor::arange(t, opts)
            .unsqueeze(1)
            .ge_tensor(&Tensor::arange(t, opts).unsqueeze(0));
        let same = doc.unsqueeze(2).eq_tensor(&doc.unsqueeze(1));
        Ok(Self {
            positions: positions.shallow_clone(),
            visible: same.logical_and(&causal).unsqueeze(1),
            longest,
        })
    }

    /// The same tensors, shared.
    pub(crate) fn shared(&self) -> Self {
        Self {
            positions: self.positions.shallow_clone(),
            visible: self.visible.shallow_clone(),
            longest: self.longest,
        }
    }
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
        assert_eq!(ints(&d.visible), want);
        // A document of one token: a repeated position starts another.
        let p = Tensor::from_slice(&[0i64, 0, 1, 0, 0]).view([1, 5]);
        let d = Documents::new(&tokens, &p).unwrap();
        assert_eq!(ints(&d.visible.diagonal(0, 2, 3)), [1; 5]);
        assert_eq!(ints(&d.visible.sum(Kind::Int64)), [6]);
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
