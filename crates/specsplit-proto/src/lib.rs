//! The SpecSplit wire protocol: messages and gRPC stubs generated from `proto/specsplit.proto`,
//! the standard gRPC health service (`grpc.health.v1`) generated with the same codec, and the
//! bearer-token authentication between the services ([`auth`]).
//!
//! Wire-compatible with the original Python SpecSplit; see the `.proto` for field documentation.
#![allow(clippy::doc_lazy_continuation, clippy::large_enum_variant)]

pub mod auth;
pub mod codec;
pub mod convert;

/// Generated protobuf messages and tonic client/server stubs for package `specsplit`.
#[allow(missing_docs)]
pub mod specsplit {
    tonic::include_proto!("specsplit");
}

/// The standard gRPC health checking protocol (`grpc.health.v1.Health`), with undecodable
/// requests answered INVALID_ARGUMENT by [`codec::SpecCodec`].
#[allow(missing_docs)]
pub mod health {
    tonic::include_proto!("grpc.health.v1");
}

pub use specsplit::*;
