//! Which elements of a unit's optimizer range its in-memory second moment
//! (`v`) keeps. Every optimizer but Muon keeps `v` for all of them or for
//! none; Muon's matrices step by a momentum alone, so under Muon the
//! in-memory `v` leaves out their pieces (the *holes*) and keeps AdamW's
//! elements only, packed in order, as DeepSpeed's Muon keeps no second
//! moment for them. Everything else that holds a `v` keeps the whole
//! range: checkpoints (zeros in the holes: a file is the same whatever
//! the run held), the NVMe swap (its arrays are all the range's length,
//! but it neither reads nor writes a chunk's `v` that holes cover:
//! [`VLayout::covers`]) and [`OwnedState`](super::OwnedState).

use std::ops::Range;

/// The holes of one unit's in-memory `v`: sorted, disjoint ranges of its
/// optimizer range whose second moment is not kept. None: `v` is the
/// whole range (or empty, for an optimizer without one).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct VLayout {
    holes: Vec<Range<usize>>,
}

/// The layout that keeps every element (the swap's chunks, every
/// optimizer but Muon).
pub(super) static WHOLE: VLayout = VLayout { holes: Vec::new() };

impl VLayout {
    /// A layout leaving out `holes` (ranges of the optimizer range, in
    /// any order; empty ones are dropped, touching ones kept apart).
    pub(super) fn without(holes: impl IntoIterator<Item = Range<usize>>) -> VLayout {
        let mut holes: Vec<_> = holes.into_iter().filter(|h| !h.is_empty()).collect();
        holes.sort_by_key(|h| h.start);
        VLayout { holes }
    }

    /// Whether every element is kept.
    pub(super) fn is_whole(&self) -> bool {
        self.holes.is_empty()
    }

    /// Whether every element of `r` lies in a hole (holes that touch
    /// count as one): the NVMe swap neither reads nor writes the second
    /// moment of a chunk so covered.
    pub(super) fn covers(&self, r: Range<usize>) -> bool {
        let mut at = r.start;
        for h in &self.holes {
            if h.start <= at && at < h.end {
                at = h.end;
            }
        }
        at >= r.end
    }

    /// How many of `len` elements the packed `v` keeps.
    pub(super) fn kept(&self, len: usize) -> usize {
        len - self.holes.iter().map(|h| h.len()).sum::<usize>()
    }

    /// Where elements `d` of the optimizer range (no hole's) lie in the
    /// packed `v`.
    pub(super) fn at(&self, d: Range<usize>) -> Range<usize> {
        debug_assert!(
            self.holes
                .iter()
                .all(|h| h.end <= d.start || d.end <= h.start),
            "{d:?} overlaps a hole of {:?}",
            self.holes
        );
        let before: usize = (self.holes.iter())
            .take_while(|h| h.end <= d.start)
            .map(|h| h.len())
            .sum();
        d.start - before..d.end - before
    }

    /// The packed `v` of `full`, a `v` over the whole optimizer range.
    pub(super) fn pack(&self, full: Vec<f32>) -> Vec<f32> {
        if self.is_whole() {
            return full;
        }
        let mut out = Vec::with_capacity(self.kept(full.len()));
        let mut at = 0;
        for h in &self.holes {
            out.extend_from_slice(&full[at..h.start]);
            at = h.end;
        }
        out.extend_from_slice(&full[at..]);
        out
    }

    /// The `v` over elements `range` of the optimizer range, of the
    /// packed `packed`: zeros in the holes. `None` when nothing is left
    /// out (`packed[range]` is already that, or `packed` is empty for an
    /// optimizer without a `v`).
    pub(super) fn unpack(&self, packed: &[f32], range: Range<usize>) -> Option<Vec<f32>> {
        if self.is_whole() {
            return None;
        }
        let mut out = vec![0f32; range.len()];
        // Each kept run [at, stop) of the range lies at `from` in `packed`.
        let (mut from, mut at) = (0, 0);
        let past = range.end.max(self.holes.last().map_or(0, |h| h.end));
        for h in self.holes.iter().chain(std::iter::once(&(past..past))) {
            let (lo, hi) = (at.max(range.start), h.start.min(range.end));
            if lo < hi {
                let src = from + lo - at..from + hi - at;
                out[lo - range.start..hi - range.start].copy_from_slice(&packed[src]);
            }
            from += h.start - at;
            at = h.end;
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packs_and_unpacks_around_the_holes() {
        let l = VLayout::without([6..8, 1..3, 4..4]);
        assert_eq!(l.kept(10), 6);
        let full: Vec<f32> = (0..10).map(|i| i as f32).collect();
        let packed = l.pack(full);
        assert_eq!(packed, vec![0.0, 3.0, 4.0, 5.0, 8.0, 9.0]);
        assert_eq!(
            l.unpack(&packed, 0..10).unwrap(),
            vec![0.0, 0.0, 0.0, 3.0, 4.0, 5.0, 0.0, 0.0, 8.0, 9.0]
        );
        // A range of it (stage 0's rank range): the same values.
        assert_eq!(
            l.unpack(&packed, 2..7).unwrap(),
            vec![0.0, 3.0, 4.0, 5.0, 0.0]
        );
        assert_eq!(l.unpack(&packed, 7..10).unwrap(), vec![0.0, 8.0, 9.0]);
        assert_eq!(l.unpack(&packed, 4..4).unwrap(), Vec::<f32>::new());
        assert_eq!(l.at(0..1), 0..1);
        assert_eq!(l.at(3..6), 1..4);
        assert_eq!(l.at(8..10), 4..6);
        // Holes at both ends.
        let l = VLayout::without([0..2, 3..5]);
        assert_eq!(l.pack(vec![1.0, 2.0, 3.0, 4.0, 5.0]), vec![3.0]);
        assert_eq!(
            l.unpack(&[3.0], 0..5).unwrap(),
            vec![0.0, 0.0, 3.0, 0.0, 0.0]
        );
        assert_eq!(l.unpack(&[3.0], 1..3).unwrap(), vec![0.0, 3.0]);
        assert_eq!(l.at(2..3), 0..1);
    }

    #[test]
    fn a_range_is_covered_when_holes_fill_every_element_of_it() {
        // Touching holes count as one; a kept element between breaks it.
        let l = VLayout::without([4..8, 0..4, 9..12]);
        let covered: Vec<bool> = [0..8, 2..6, 5..5, 0..9, 7..10, 9..12, 10..13]
            .into_iter()
            .map(|r| l.covers(r))
            .collect();
        assert_eq!(covered, [true, true, true, false, false, true, false]);
        assert!(!WHOLE.covers(0..1) && WHOLE.covers(3..3));
    }

    #[test]
    fn the_whole_layout_changes_nothing() {
        assert!(WHOLE.is_whole());
        assert_eq!(WHOLE.pack(vec![1.0, 2.0]), vec![1.0, 2.0]);
        assert_eq!(WHOLE.unpack(&[1.0, 2.0], 0..2), None);
        assert_eq!(WHOLE.at(3..5), 3..5);
        assert_eq!(WHOLE.kept(7), 7);
        assert!(VLayout::without([2..2, 5..5]).is_whole());
    }
}
