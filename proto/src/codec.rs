//! The protocol's codec: tonic's prost codec with a smaller yield threshold.
//!
//! tonic encodes the messages a stream has ready into one buffer and hands it to HTTP/2
//! once it holds `yield_threshold` bytes (32 KiB by default). The buffer keeps the size
//! it grew to for the stream's life, idle or not: a hub holding 10,000 sessions kept
//! 32 KiB of encode buffer each. Handed on at 8 KiB, a burst grows it to 16 KiB at most
//! (unless one message is larger), and HTTP/2 sends each hand-off as one DATA frame
//! instead of splitting it: 10,000 held sessions take ~200 MiB less, for a few percent
//! more CPU in the push (BENCHMARKS.md, "The encode buffer a held session keeps").

use std::marker::PhantomData;

use prost::Message;
use tonic::codec::BufferSettings;
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

/// A stream's encoded messages are handed to HTTP/2 once they reach this many bytes.
pub const YIELD_THRESHOLD: usize = 8 * 1024;

/// The buffer each stream's encoder and decoder starts with (tonic's default).
const BUFFER_SIZE: usize = 8 * 1024;

/// `application/grpc+proto` by prost, as [`ProstCodec`], with [`YIELD_THRESHOLD`].
#[derive(Debug, Clone, Copy)]
pub struct Codec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for Codec<T, U> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

fn settings() -> BufferSettings {
    BufferSettings::new(BUFFER_SIZE, YIELD_THRESHOLD)
}

impl<T, U> tonic::codec::Codec for Codec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = ProstDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstCodec::<T, U>::raw_encoder(settings())
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstCodec::<T, U>::raw_decoder(settings())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::{Apply, HubMessage, hub_message};
    use http_body_util::BodyExt;
    use tonic::Status;
    use tonic::codec::{Codec as _, EncodeBody, SingleMessageCompressionOverride};

    fn apply(i: usize) -> HubMessage {
        HubMessage {
            kind: Some(hub_message::Kind::Apply(Apply {
                key: None,
                hash: format!("{i:064}"),
                manifest: vec![b'x'; 2000].into(),
            })),
        }
    }

    /// What a session's stream hands to HTTP/2 when 1,000 Applies are ready at once (a
    /// new session's initial diff): the sizes of the chunks, in order.
    async fn chunks_of_a_burst(encoder: ProstEncoder<HubMessage>) -> Vec<usize> {
        let ready = tokio_stream::iter((0..1000).map(|i| Ok::<_, Status>(apply(i))));
        let body = EncodeBody::new_server(
            encoder,
            ready,
            None,
            SingleMessageCompressionOverride::default(),
            None,
        );
        let mut body = std::pin::pin!(body);
        let mut chunks = Vec::new();
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame.expect("encoded").into_data() {
                chunks.push(data.len());
            }
        }
        chunks
    }

    #[tokio::test]
    async fn a_burst_is_handed_on_in_chunks_of_the_yield_threshold() {
        let message = apply(0).encoded_len() + 5;
        let ours = chunks_of_a_burst(Codec::<HubMessage, HubMessage>::default().encoder()).await;
        let total: usize = ours.iter().sum();
        assert_eq!(total, 1000 * message, "every Apply is sent whole");
        assert!(
            ours.iter().all(|&c| c < YIELD_THRESHOLD + message),
            "a chunk past the threshold and one message: {ours:?}"
        );
        assert!(
            ours[..ours.len() - 1].iter().all(|&c| c >= YIELD_THRESHOLD),
            "every chunk but the last fills the threshold: {ours:?}"
        );
        // tonic's own default fills four times as much before handing on.
        let default =
            chunks_of_a_burst(ProstCodec::<HubMessage, HubMessage>::default().encoder()).await;
        assert!(default[0] >= 4 * YIELD_THRESHOLD, "{default:?}");
    }
}
