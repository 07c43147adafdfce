//! The frames of the node link: length-delimited, each a bincode 2
//! envelope of an id and a body. The link matches replies to requests by
//! the id alone; what a body says is the business of whoever speaks over
//! the link (`crate::wire`).

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Largest frame accepted on the node link.
pub const MAX_FRAME: usize = 256 << 20;

#[derive(Serialize)]
struct Envelope<'a, T: ?Sized> {
    id: u64,
    body: &'a T,
}

/// A frame carrying `body` under `id`.
pub fn frame<T: Serialize + ?Sized>(id: u64, body: &T) -> Result<Bytes, bincode::error::EncodeError> {
    encode(&Envelope { id, body }).map(Bytes::from)
}

/// A frame's id and its body, still encoded; `None` if it has no id.
pub fn open(frame: &Bytes) -> Option<(u64, Bytes)> {
    let (id, read): (u64, usize) = bincode::serde::decode_from_slice(frame, bincode::config::standard()).ok()?;
    Some((id, frame.slice(read..)))
}

pub fn encode<T: Serialize + ?Sized>(v: &T) -> Result<Vec<u8>, bincode::error::EncodeError> {
    bincode::serde::encode_to_vec(v, bincode::config::standard())
}

pub fn decode<T: DeserializeOwned>(b: &[u8]) -> Result<T, bincode::error::DecodeError> {
    bincode::serde::decode_from_slice(b, bincode::config::standard()).map(|(v, _)| v)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A frame opens into the id and the body it was made of, whatever the
    /// body's type: the link never needs to know it.
    #[test]
    fn a_frame_opens_into_its_id_and_body() {
        let body = ("a body".to_string(), vec![1u64, 2, 3]);
        for id in [0, 1, 300, u64::MAX] {
            let f = frame(id, &body).unwrap();
            let (got, rest) = open(&f).unwrap();
            assert_eq!(got, id);
            assert_eq!(decode::<(String, Vec<u64>)>(&rest).unwrap(), body);
        }
        assert!(open(&Bytes::new()).is_none(), "an empty frame has no id");
    }
}
