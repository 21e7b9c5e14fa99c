//! The flat-buffer layout of one unit (DESIGN.md, "Flat buffers").
//!
//! A unit's parameters are ordered by name (VarStore's map order is random;
//! sorting makes every rank agree), each start is aligned to [`ALIGN`]
//! elements, and the total is padded to a multiple of `shards x ALIGN` so
//! every shard has the same length. Padding is zeros that never reach a norm
//! or an update (their gradients are zero, so Adam leaves them at zero).

use std::ops::Range;

/// Alignment of every parameter's start, in elements.
pub const ALIGN: usize = 16;

/// Where one parameter lives in its unit's flat buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    /// The VarStore name.
    pub name: String,
    /// The parameter's shape.
    pub shape: Vec<i64>,
    /// First element in the flat buffer.
    pub offset: usize,
    /// Elements.
    pub numel: usize,
}

/// One unit's layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlatLayout {
    /// Parameters in flat order (sorted by name).
    pub slots: Vec<Slot>,
    /// Elements including alignment and padding; a multiple of `shards x ALIGN`.
    pub padded: usize,
    /// Elements of real parameters.
    pub numel: usize,
    /// Shards the buffer is split into.
    pub shards: usize,
}

impl FlatLayout {
    /// Lays out `params` (name, shape) for `shards` shards.
    pub fn new(mut params: Vec<(String, Vec<i64>)>, shards: usize) -> Self {
        params.sort_by(|a, b| a.0.cmp(&b.0));
        let mut offset = 0;
        let mut numel = 0;
        let slots = params
            .into_iter()
            .map(|(name, shape)| {
                let n = shape.iter().product::<i64>().max(0) as usize;
                let s = Slot {
                    name,
                    shape,
                    offset,
                    numel: n,
                };
                offset = (offset + n).div_ceil(ALIGN) * ALIGN;
                numel += n;
                s
            })
            .collect();
        let unit = shards.max(1) * ALIGN;
        Self {
            slots,
            padded: offset.div_ceil(unit) * unit,
            numel,
            shards: shards.max(1),
        }
    }

    /// Elements per shard.
    pub fn shard_len(&self) -> usize {
        self.padded / self.shards
    }

    /// Shard `i`'s range of the flat buffer.
    pub fn shard(&self, i: usize) -> Range<usize> {
        let l = self.shard_len();
        i * l..(i + 1) * l
    }

    /// The parameters that overlap `range` of the flat buffer, each with
    /// the overlap in its own elements and in `range`'s (offsets from
    /// `range.start`): what a rank reads of each saved parameter to fill
    /// its part of the buffer.
    pub fn pieces(
        &self,
        range: Range<usize>,
    ) -> impl Iterator<Item = (&Slot, Range<usize>, Range<usize>)> {
        self.indexed_pieces(range)
            .map(|(_, s, own, dst)| (s, own, dst))
    }

    /// [`FlatLayout::pieces`], each with its parameter's index in
    /// [`FlatLayout::slots`] first (LAMB keeps its sums by that index).
    pub fn indexed_pieces(
        &self,
        range: Range<usize>,
    ) -> impl Iterator<Item = (usize, &Slot, Range<usize>, Range<usize>)> {
        self.slots.iter().enumerate().filter_map(move |(j, s)| {
            let lo = range.start.max(s.offset);
            let hi = range.end.min(s.offset + s.numel);
            (lo < hi).then(|| {
                (
                    j,
                    s,
                    lo - s.offset..hi - s.offset,
                    lo - range.start..hi - range.start,
                )
            })
        })
    }

    /// `range` of the flat buffer cut at every parameter's start and end
    /// (padding and alignment gaps become segments of their own): the
    /// lengths of the segments, in order, summing to `range.len()`. ZeRO++
    /// packs each segment on its own, so that no quantization scale spans
    /// two parameters.
    pub fn segments(&self, range: Range<usize>) -> Vec<usize> {
        let mut at: Vec<usize> = (self.slots.iter())
            .flat_map(|s| [s.offset, s.offset + s.numel])
            .filter(|b| range.contains(b))
            .chain([range.start, range.end])
            .collect();
        at.sort_unstable();
        at.dedup();
        at.windows(2).map(|w| w[1] - w[0]).collect()
    }

    /// Every shard's [`FlatLayout::segments`], in shard order: how each
    /// rank packs its shard, which every rank must know to unpack them all.
    pub fn shard_segments(&self) -> Vec<Vec<usize>> {
        (0..self.shards)
            .map(|r| self.segments(self.shard(r)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sorted_aligned_and_padded_to_equal_shards() {
        let l = FlatLayout::new(
            vec![("b.weight".into(), vec![3, 5]), ("a.bias".into(), vec![7])],
            3,
        );
        assert_eq!(l.slots[0].name, "a.bias");
        assert_eq!((l.slots[0].offset, l.slots[0].numel), (0, 7));
        assert_eq!((l.slots[1].offset, l.slots[1].numel), (16, 15));
        // 16 + 15 = 31 -> aligned 32 -> padded to a multiple of 3 x 16 = 48.
        assert_eq!(l.padded, 48);
        assert_eq!(l.shard(2), 32..48);
        assert_eq!(l.numel, 22);
        // Shard 0 is 0..16: all of a.bias; shard 1, 16..32: b.weight's
        // first 15 elements (16..31), then padding.
        let names = |r| {
            l.pieces(r)
                .map(|(s, a, b)| (s.name.as_str(), a, b))
                .collect::<Vec<_>>()
        };
        assert_eq!(names(0..16), vec![("a.bias", 0..7, 0..7)]);
        assert_eq!(names(16..32), vec![("b.weight", 0..15, 0..15)]);
        assert_eq!(names(20..40), vec![("b.weight", 4..15, 0..11)]);
        assert!(names(32..48).is_empty());
        // The same pieces, each after its index in `slots`.
        let indexed: Vec<_> = l
            .indexed_pieces(5..20)
            .map(|(j, s, ..)| (j, s.offset))
            .collect();
        assert_eq!(indexed, [(0, 0), (1, 16)]);
        // Cut at a.bias's end (7), b.weight's start (16) and end (31).
        assert_eq!(l.segments(0..48), [7, 9, 15, 17]);
        assert_eq!(l.segments(l.shard(1)), [15, 1]);
        assert_eq!(l.segments(20..40), [11, 9]);
        assert_eq!(l.segments(32..48), [16]);
        assert!(l.segments(5..5).is_empty());
        assert_eq!(l.shard_segments(), [vec![7, 9], vec![15, 1], vec![16]]);
    }
}
