//! The gRPC codec of every service: prost's encoding, except that a message that cannot be
//! decoded is answered INVALID_ARGUMENT (the sender's fault) with a short message saying why,
//! where prost's own codec answers INTERNAL with the decoder's whole field path.
//!
//! A draft tree travels as nested `TokenNode`s, one protobuf nesting level per tree level, and
//! protobuf decoders stop at 100 nesting levels: a tree deeper than [`MAX_WIRE_TREE_DEPTH`]
//! cannot be decoded, and the error says so.

use std::marker::PhantomData;

use prost::Message;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic::Status;
use tonic_prost::ProstEncoder;

/// Deepest draft tree (tokens on a root-to-leaf path) that a `DraftResponse` or a
/// `VerifyRequest` can carry through protobuf's recursion limit, with a distribution on every
/// node (checked by this module's round-trip test).
pub const MAX_WIRE_TREE_DEPTH: usize = 99;

/// Longest decoder reason quoted in an INVALID_ARGUMENT message, in bytes.
const MAX_REASON_BYTES: usize = 120;

/// prost encoding; undecodable messages become INVALID_ARGUMENT (see the module docs).
#[derive(Debug, Clone)]
pub struct SpecCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for SpecCodec<T, U> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<T, U> Codec for SpecCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = SpecDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::default()
    }

    fn decoder(&mut self) -> Self::Decoder {
        SpecDecoder(PhantomData)
    }
}

/// prost decoding with decode failures mapped to INVALID_ARGUMENT ([`decode_error_status`]).
#[derive(Debug, Clone)]
pub struct SpecDecoder<U>(PhantomData<U>);

impl<U: Message + Default> Decoder for SpecDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        U::decode(buf)
            .map(Some)
            .map_err(|e| decode_error_status(&e))
    }

    fn buffer_settings(&self) -> BufferSettings {
        BufferSettings::default()
    }
}

/// The INVALID_ARGUMENT status of a message prost could not decode: the depth limit when
/// that was the cause, else "could not be decoded: <reason>" with the innermost field and the
/// reason, at most [`MAX_REASON_BYTES`] of it.
pub fn decode_error_status(e: &prost::DecodeError) -> Status {
    let text = e.to_string();
    let rest = text
        .strip_prefix("failed to decode Protobuf message: ")
        .unwrap_or(&text);
    // `rest` is "Msg.field: Msg.field: ... reason", innermost field first.
    let mut field = None;
    let mut reason = rest;
    while let Some((head, tail)) = reason.split_once(": ") {
        let is_field = head.contains('.') && !head.contains(' ');
        if !is_field {
            break;
        }
        field.get_or_insert(head);
        reason = tail;
    }
    if reason == "recursion limit reached" {
        return Status::invalid_argument(format!(
            "the message could not be decoded: it nests deeper than protobuf's limit; a draft \
             tree may be at most {MAX_WIRE_TREE_DEPTH} levels deep on the wire"
        ));
    }
    let full = match field {
        Some(f) => format!("{f}: {reason}"),
        None => reason.to_string(),
    };
    Status::invalid_argument(format!(
        "the message could not be decoded: {}",
        truncate(&full, MAX_REASON_BYTES)
    ))
}

/// At most `max` bytes of `s`, cut at a character boundary, with "…" when cut.
fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::health::HealthCheckRequest as HealthCheckRequestShim;
    use crate::{DraftDistribution, DraftResponse, TokenNode, VerifyRequest};

    /// A chain of `depth` nodes, each with a child distribution.
    fn chain(depth: usize) -> Vec<TokenNode> {
        let mut node: Option<TokenNode> = None;
        for i in (0..depth).rev() {
            node = Some(TokenNode {
                token_id: i as i32,
                children: node.into_iter().collect(),
                child_distribution: Some(DraftDistribution {
                    token_ids: vec![1, 2],
                    probs: vec![0.5, 0.5],
                }),
                ..Default::default()
            });
        }
        node.into_iter().collect()
    }

    fn roundtrip<M: Message + Default>(m: &M) -> Result<M, Status> {
        let bytes = m.encode_to_vec();
        M::decode(bytes.as_slice()).map_err(|e| decode_error_status(&e))
    }

    #[test]
    fn the_wire_depth_limit_is_the_deepest_tree_that_decodes() {
        for (deepest, too_deep) in [
            (
                roundtrip(&DraftResponse {
                    draft_tree: chain(MAX_WIRE_TREE_DEPTH),
                    ..Default::default()
                })
                .map(|_| ()),
                roundtrip(&DraftResponse {
                    draft_tree: chain(MAX_WIRE_TREE_DEPTH + 1),
                    ..Default::default()
                })
                .map(|_| ()),
            ),
            (
                roundtrip(&VerifyRequest {
                    draft_tree: chain(MAX_WIRE_TREE_DEPTH),
                    ..Default::default()
                })
                .map(|_| ()),
                roundtrip(&VerifyRequest {
                    draft_tree: chain(MAX_WIRE_TREE_DEPTH + 1),
                    ..Default::default()
                })
                .map(|_| ()),
            ),
        ] {
            deepest.expect("the deepest allowed tree decodes");
            let e = too_deep.expect_err("one level more does not");
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
            assert!(e.message().contains("levels deep"), "{}", e.message());
            assert!(e.message().len() < 200, "{}", e.message());
        }
    }

    #[test]
    fn garbage_and_bad_utf8_are_not_blamed_on_depth() {
        // Field 1 (request_id, a string) holding invalid UTF-8.
        let bad_utf8 = [0x0a, 0x02, 0xff, 0xfe];
        let e = VerifyRequest::decode(&bad_utf8[..])
            .map_err(|e| decode_error_status(&e))
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(!e.message().contains("deep"), "{}", e.message());
        assert!(
            e.message().contains("could not be decoded"),
            "{}",
            e.message()
        );
        assert!(e.message().contains("UTF-8"), "{}", e.message());
        let garbage = [0xffu8; 64];
        let e = HealthCheckRequestShim::decode(&garbage[..])
            .map_err(|e| decode_error_status(&e))
            .unwrap_err();
        assert!(!e.message().contains("deep"), "{}", e.message());
        assert!(e.message().len() <= 200, "{}", e.message());
    }

    #[test]
    fn long_reasons_are_cut() {
        assert_eq!(truncate("abc", 5), "abc");
        assert_eq!(truncate("abcdef", 3), "abc…");
        assert_eq!(truncate("ééé", 3), "é…");
    }
}
