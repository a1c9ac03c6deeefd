//! The SpecSplit wire protocol: messages and gRPC stubs generated from `proto/specsplit.proto`.
//!
//! Wire-compatible with the original Python SpecSplit; see the `.proto` for field documentation.
#![allow(clippy::doc_lazy_continuation, clippy::large_enum_variant)]

pub mod codec;

/// Generated protobuf messages and tonic client/server stubs for package `specsplit`.
#[allow(missing_docs)]
pub mod specsplit {
    tonic::include_proto!("specsplit");
}

pub use specsplit::*;
