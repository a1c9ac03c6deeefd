//! Compiles the fused decode kernels (`src/cuda/kernels.cu`, which includes one file per kernel
//! family from the same directory) to PTX when the `cuda` feature is on. The PTX targets
//! `compute_$CUDA_COMPUTE_CAP` (default 80), which the driver JIT-compiles for the GPU it runs
//! on; nvcc is `$NVCC`, else `$CUDA_HOME/bin/nvcc`, else `nvcc` on the PATH.

use std::env;
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    // Every .cu and .cuh file of the directory (cargo watches a directory's whole contents).
    println!("cargo::rerun-if-changed=src/cuda");
    for var in ["CUDA_COMPUTE_CAP", "NVCC", "CUDA_HOME"] {
        println!("cargo::rerun-if-env-changed={var}");
    }
    // Set when the PTX is built for sm_90 or later: src/fused/cuda.rs launches with programmatic
    // dependent launch only then.
    println!("cargo::rustc-check-cfg=cfg(specsplit_pdl)");
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"))
        .join("specsplit_kernels.ptx");
    let cap: u32 = env::var("CUDA_COMPUTE_CAP")
        .ok()
        .and_then(|c| c.trim().trim_end_matches('a').parse().ok())
        .unwrap_or(80);
    let nvcc = env::var("NVCC")
        .ok()
        .or_else(|| env::var("CUDA_HOME").ok().map(|h| format!("{h}/bin/nvcc")))
        .unwrap_or_else(|| "nvcc".into());
    if cap >= 90 {
        println!("cargo::rustc-cfg=specsplit_pdl");
    }
    let status = Command::new(&nvcc)
        .args([
            "--ptx",
            "-O3",
            "-std=c++17",
            &format!("-arch=compute_{cap}"),
            "-o",
        ])
        .arg(&out)
        .arg("src/cuda/kernels.cu")
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("{nvcc} failed ({s}) compiling src/cuda/kernels.cu"),
        Err(e) => panic!(
            "could not run {nvcc} ({e}): the `cuda` feature needs the CUDA toolkit; set NVCC or \
             CUDA_HOME"
        ),
    }
}
