//! Adam on a CUDA device: the same update as [`crate::adam`], compiled at run
//! time with NVRTC through cudarc (dynamic loading: nothing CUDA is needed to
//! build).
//!
//! **This code has never run on a GPU**: no GPU is available to the project.
//! It is compiled in CI (`cargo check --features cuda`). It is written to
//! compute the CPU kernel's exact rounding sequence (`__fmul_rn`, `__fadd_rn`,
//! `__fdiv_rn` forbid contraction; `fmaf` where the CPU uses `mul_add`; IEEE
//! `sqrtf`), so CPU and GPU results should agree to the bit, but that is
//! unverified.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};

use crate::adam::Coef;
use crate::{AdamConfig, KernelError};

/// Why the CUDA kernel could not be built or launched.
#[derive(Debug, thiserror::Error)]
pub enum CudaKernelError {
    /// NVRTC rejected the source or is not installed.
    #[error("compiling the CUDA Adam kernel with NVRTC failed: {0}")]
    Compile(String),
    /// The driver refused to load or launch it.
    #[error("CUDA driver error in the Adam kernel: {0}")]
    Driver(String),
    /// The arguments were invalid.
    #[error(transparent)]
    Kernel(#[from] KernelError),
}

const SOURCE: &str = r#"
__device__ unsigned short zrt_bf16(float x) {
    unsigned int b = __float_as_uint(x);
    if (x != x) return 0xFFFF;
    return (unsigned short)((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
}
__device__ unsigned short zrt_f16(float x) {
    unsigned int bits = __float_as_uint(x);
    unsigned short sign = (unsigned short)((bits >> 16) & 0x8000);
    unsigned int a = bits & 0x7FFFFFFF;
    unsigned short out;
    if (a >= (143u << 23)) {
        out = a > (255u << 23) ? (unsigned short)(0x7E00 | ((a >> 13) & 0x3FF)) : 0x7C00;
    } else if (a < (113u << 23)) {
        float f = __fadd_rn(__uint_as_float(a), __uint_as_float(126u << 23));
        out = (unsigned short)(__float_as_uint(f) - (126u << 23));
    } else {
        unsigned int odd = (a >> 13) & 1;
        out = (unsigned short)((a + 0xC8000FFFu + odd) >> 13);
    }
    return out | sign;
}
extern "C" __global__ void zrt_adam(
    float* p, const float* g, float* m, float* v, unsigned short* copy, int copy_kind,
    unsigned long long n, float scale, float beta1, float omb1, float beta2, float omb2,
    float eps, float l2, float decay, float neg_step, float bc2_sqrt)
{
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float pi = p[i];
        float gi = __fmul_rn(g[i], scale);
        if (l2 != 0.0f) gi = fmaf(pi, l2, gi);
        float mi = fmaf(gi, omb1, __fmul_rn(m[i], beta1));
        float vi = __fadd_rn(__fmul_rn(v[i], beta2), __fmul_rn(__fmul_rn(omb2, gi), gi));
        float denom = __fadd_rn(__fdiv_rn(sqrtf(vi), bc2_sqrt), eps);
        float np = __fadd_rn(__fmul_rn(pi, decay), __fdiv_rn(__fmul_rn(neg_step, mi), denom));
        p[i] = np; m[i] = mi; v[i] = vi;
        if (copy_kind == 1) copy[i] = zrt_bf16(np);
        else if (copy_kind == 2) copy[i] = zrt_f16(np);
    }
}
"#;

/// Raw device pointers of one rank's shard (e.g. from tch tensors'
/// `data_ptr()`), each `len` f32 elements.
#[derive(Debug, Clone, Copy)]
pub struct DeviceShard {
    /// fp32 master parameters.
    pub p: u64,
    /// fp32 gradients.
    pub g: u64,
    /// First moment.
    pub m: u64,
    /// Second moment.
    pub v: u64,
    /// Elements in each.
    pub len: usize,
}

/// Optional compute-dtype copy on the device (`len` 16-bit elements).
#[derive(Debug, Clone, Copy)]
pub enum DeviceCopy {
    /// No copy.
    None,
    /// Write bf16 bits here.
    Bf16(u64),
    /// Write f16 bits here.
    F16(u64),
}

/// The compiled kernel, bound to a stream.
pub struct CudaAdam {
    stream: Arc<CudaStream>,
    func: CudaFunction,
}

impl CudaAdam {
    /// Compiles the kernel with NVRTC and loads it into the stream's context.
    pub fn new(stream: Arc<CudaStream>) -> Result<Self, CudaKernelError> {
        let ptx = cudarc::nvrtc::compile_ptx(SOURCE)
            .map_err(|e| CudaKernelError::Compile(e.to_string()))?;
        let module = stream
            .context()
            .load_module(ptx)
            .map_err(|e| CudaKernelError::Driver(e.to_string()))?;
        let func = module
            .load_function("zrt_adam")
            .map_err(|e| CudaKernelError::Driver(e.to_string()))?;
        Ok(Self { stream, func })
    }

    /// Enqueues one Adam step on the stream (asynchronous).
    ///
    /// # Safety
    /// Every pointer must be a live device allocation of the stream's context
    /// with `shard.len` elements, not written by anything else until the
    /// stream has run this kernel.
    pub unsafe fn step(
        &self,
        cfg: &AdamConfig,
        step: u64,
        grad_scale: f32,
        shard: DeviceShard,
        copy: DeviceCopy,
    ) -> Result<(), CudaKernelError> {
        let c = Coef::new(cfg, step, grad_scale)?;
        let (copy_ptr, copy_kind): (u64, i32) = match copy {
            DeviceCopy::None => (0, 0),
            DeviceCopy::Bf16(p) => (p, 1),
            DeviceCopy::F16(p) => (p, 2),
        };
        let n = shard.len as u64;
        let blocks = shard.len.div_ceil(256).clamp(1, 65_535) as u32;
        let launch = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(&self.func);
        b.arg(&shard.p)
            .arg(&shard.g)
            .arg(&shard.m)
            .arg(&shard.v)
            .arg(&copy_ptr)
            .arg(&copy_kind)
            .arg(&n);
        b.arg(&c.scale)
            .arg(&c.beta1)
            .arg(&c.one_minus_beta1)
            .arg(&c.beta2)
            .arg(&c.one_minus_beta2);
        b.arg(&c.eps)
            .arg(&c.l2)
            .arg(&c.decay)
            .arg(&c.neg_step_size)
            .arg(&c.bc2_sqrt);
        // SAFETY: argument types and order match `zrt_adam`'s signature; the
        // caller guarantees the pointers.
        unsafe { b.launch(launch) }.map_err(|e| CudaKernelError::Driver(e.to_string()))?;
        Ok(())
    }
}
