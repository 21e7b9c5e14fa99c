//! A matrix written or read as its transpose (GPT-2's Conv1D keeps
//! `[in, out]` where a linear keeps `[out, in]`): where each element of
//! the transpose is in the matrix's row-major data. Loads read through it
//! element by element from the mapped file
//! ([`WeightsFiles`](super::weights_files)); exports copy through it
//! ([`ExportLayout`](super::ExportLayout)).

/// A `[rows, cols]` matrix seen as its transpose, `[cols, rows]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Transpose {
    /// The matrix's rows.
    pub(crate) rows: usize,
    /// The matrix's columns.
    pub(crate) cols: usize,
}

impl Transpose {
    /// Where element `k` of the transpose (row-major) is in the matrix:
    /// the transpose's `(c, r)` is the matrix's `(r, c)`.
    pub(crate) fn source(&self, k: usize) -> usize {
        (k % self.rows) * self.cols + k / self.rows
    }

    /// The transpose of `data` (the matrix, row-major, `size`-byte
    /// elements), in a copy.
    pub(crate) fn copy(&self, data: &[u8], size: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(data.len());
        for k in 0..(data.len() / size.max(1)).min(self.rows * self.cols) {
            out.extend_from_slice(&data[self.source(k) * size..][..size]);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_transpose_reads_each_column_as_a_row() {
        // [[1, 2, 3], [4, 5, 6]] is [[1, 4], [2, 5], [3, 6]].
        let t = Transpose { rows: 2, cols: 3 };
        let at: Vec<usize> = (0..6).map(|k| t.source(k)).collect();
        assert_eq!(at, [0, 3, 1, 4, 2, 5]);
        let data: Vec<u8> = (1..=6u16).flat_map(u16::to_le_bytes).collect();
        let got: Vec<u16> = (t.copy(&data, 2).chunks_exact(2))
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect();
        assert_eq!(got, [1, 4, 2, 5, 3, 6]);
    }
}
