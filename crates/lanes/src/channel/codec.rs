//! Codecs: how a record becomes bytes for a spill queue (overflow, output, dead letters), once.

use std::fmt;
use std::marker::PhantomData;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::BoxError;

/// Encodes records to bytes and back.
pub trait Codec<T>: Send + Sync {
    /// Encodes one record.
    ///
    /// # Errors
    ///
    /// The record cannot be encoded.
    fn encode(&self, record: &T) -> Result<Vec<u8>, BoxError>;

    /// Decodes one record.
    ///
    /// # Errors
    ///
    /// The bytes are not a record.
    fn decode(&self, bytes: &[u8]) -> Result<T, BoxError>;

    /// Identifies the encoding: two codecs with the same id read each other's bytes. Defaults
    /// to the codec's type name.
    fn codec_id(&self) -> &'static str {
        std::any::type_name::<Self>()
    }
}

/// JSON through serde: readable, larger.
///
/// # Examples
///
/// ```
/// use lanes::channel::{Codec, JsonCodec};
///
/// let codec = JsonCodec::new();
/// let bytes = codec.encode(&vec![1u32, 2, 3]).unwrap();
/// assert_eq!(bytes, b"[1,2,3]");
/// assert_eq!(Codec::<Vec<u32>>::decode(&codec, &bytes).unwrap(), [1, 2, 3]);
/// ```
pub struct JsonCodec<T = ()>(PhantomData<fn() -> T>);

/// A compact binary encoding through serde (postcard: varints, no field names).
///
/// # Examples
///
/// ```
/// use lanes::channel::{BinaryCodec, Codec};
///
/// let codec = BinaryCodec::new();
/// let bytes = codec.encode(&(7u64, "seven".to_owned())).unwrap();
/// assert_eq!(bytes.len(), 7);
/// assert_eq!(Codec::<(u64, String)>::decode(&codec, &bytes).unwrap(), (7, "seven".to_owned()));
/// ```
pub struct BinaryCodec<T = ()>(PhantomData<fn() -> T>);

macro_rules! codec_basics {
    ($name:ident) => {
        impl $name {
            /// The codec.
            pub const fn new() -> Self {
                Self(PhantomData)
            }
        }

        impl<T> Default for $name<T> {
            fn default() -> Self {
                Self(PhantomData)
            }
        }

        impl<T> Clone for $name<T> {
            fn clone(&self) -> Self {
                *self
            }
        }

        impl<T> Copy for $name<T> {}

        impl<T> fmt::Debug for $name<T> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(stringify!($name))
            }
        }
    };
}

codec_basics!(JsonCodec);
codec_basics!(BinaryCodec);

impl<T: Serialize + DeserializeOwned, M: 'static> Codec<T> for JsonCodec<M> {
    fn encode(&self, record: &T) -> Result<Vec<u8>, BoxError> {
        Ok(serde_json::to_vec(record)?)
    }

    fn decode(&self, bytes: &[u8]) -> Result<T, BoxError> {
        Ok(serde_json::from_slice(bytes)?)
    }

    fn codec_id(&self) -> &'static str {
        "lanes::json"
    }
}

impl<T: Serialize + DeserializeOwned, M: 'static> Codec<T> for BinaryCodec<M> {
    fn encode(&self, record: &T) -> Result<Vec<u8>, BoxError> {
        Ok(postcard::to_allocvec(record)?)
    }

    fn decode(&self, bytes: &[u8]) -> Result<T, BoxError> {
        Ok(postcard::from_bytes(bytes)?)
    }

    fn codec_id(&self) -> &'static str {
        "lanes::postcard"
    }
}

/// The bytes a consumer writes to its output or dead-letter queue: the record's tags, then the
/// record encoded once by the codec.
///
/// ```text
/// u8   tag count
/// per tag: u16 length (little-endian), UTF-8 bytes
/// the encoded record
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope {
    /// Failure tags (empty for a record processed successfully).
    pub tags: Vec<String>,
    /// The record, as the codec encoded it.
    pub payload: Vec<u8>,
}

impl Envelope {
    /// The envelope's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(
            1 + self.payload.len() + self.tags.iter().map(|t| 2 + t.len()).sum::<usize>(),
        );
        out.push(u8::try_from(self.tags.len()).unwrap_or(u8::MAX));
        for tag in self.tags.iter().take(usize::from(u8::MAX)) {
            let len = u16::try_from(tag.len()).unwrap_or(u16::MAX);
            out.extend_from_slice(&len.to_le_bytes());
            out.extend_from_slice(&tag.as_bytes()[..usize::from(len)]);
        }
        out.extend_from_slice(&self.payload);
        out
    }

    /// Reads an envelope back.
    ///
    /// # Errors
    ///
    /// The bytes are not an envelope.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, BoxError> {
        let (&count, mut rest) = bytes.split_first().ok_or("empty envelope")?;
        let mut tags = Vec::with_capacity(usize::from(count));
        for _ in 0..count {
            let (len, after) = rest.split_at_checked(2).ok_or("truncated tag length")?;
            let len = usize::from(u16::from_le_bytes([len[0], len[1]]));
            let (tag, after) = after.split_at_checked(len).ok_or("truncated tag")?;
            tags.push(String::from_utf8(tag.to_vec())?);
            rest = after;
        }
        Ok(Self { tags, payload: rest.to_vec() })
    }
}
