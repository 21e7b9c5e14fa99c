//! Inputs the optimizer kernels' unit tests share.

/// `n` parameters in [-1.67, 1.67] and gradients in [-1.21, 1.21], spread
/// by two coprime strides so that neighbours differ.
pub(crate) fn start(n: usize) -> (Vec<f32>, Vec<f32>) {
    let p = (0..n)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 30.0)
        .collect();
    let g = (0..n)
        .map(|i| ((i * 53 % 97) as f32 - 48.5) / 40.0)
        .collect();
    (p, g)
}

/// `v`'s bit patterns, to compare results exactly (NaN included).
pub(crate) fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}
