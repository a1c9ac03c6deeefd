//! The gRPC codec of both services: prost's encoding, except that a message that cannot be
//! decoded is answered INVALID_ARGUMENT (the sender's fault) with a message saying why, where
//! prost's own codec answers INTERNAL.
//!
//! The common cause is depth: a draft tree travels as nested `TokenNode`s, one protobuf
//! nesting level per tree level, and protobuf decoders stop at 100 nesting levels.

use std::marker::PhantomData;

use prost::Message;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic::Status;
use tonic_prost::{ProstDecoder, ProstEncoder};

/// Deepest draft tree the wire format can carry (protobuf's recursion limit).
pub const MAX_WIRE_TREE_DEPTH: usize = 100;

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
        SpecDecoder(ProstDecoder::default())
    }
}

/// prost's decoder with decode failures mapped to INVALID_ARGUMENT.
#[derive(Debug, Clone)]
pub struct SpecDecoder<U>(ProstDecoder<U>);

impl<U: Message + Default> Decoder for SpecDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        self.0.decode(buf).map_err(|s| {
            Status::invalid_argument(format!(
                "the message could not be decoded ({}); a draft tree may be at most \
                 {MAX_WIRE_TREE_DEPTH} levels deep on the wire",
                s.message()
            ))
        })
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}
