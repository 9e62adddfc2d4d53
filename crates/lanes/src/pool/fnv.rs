//! FNV-1a 64, the shard function of the hashed mode (the seed's exact function).

use std::borrow::Cow;
use std::hash::Hash;
use std::sync::Arc;

const OFFSET_BASIS: u64 = 14_695_981_039_346_656_037;
const PRIME: u64 = 1_099_511_628_211;

/// The 64-bit FNV-1a hash of `bytes`: per byte, `h ^= b; h *= prime`.
///
/// # Examples
///
/// ```
/// assert_eq!(lanes::pool::fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
/// assert_eq!(lanes::pool::fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
/// ```
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(OFFSET_BASIS, |h, b| (h ^ u64::from(*b)).wrapping_mul(PRIME))
}

/// A key of a [`KeyedPool`](super::KeyedPool): compared for per-key order, and hashed by its
/// bytes for the hashed-shards mode.
///
/// Implemented for strings, byte strings and integers (big-endian bytes).
pub trait PoolKey: Hash + Eq + Clone + Send + Sync + 'static {
    /// The bytes the shard function hashes.
    fn key_bytes(&self) -> Cow<'_, [u8]>;
}

macro_rules! str_key {
    ($($ty:ty),*) => {$(
        impl PoolKey for $ty {
            fn key_bytes(&self) -> Cow<'_, [u8]> {
                let text: &str = self;
                Cow::Borrowed(text.as_bytes())
            }
        }
    )*};
}

macro_rules! bytes_key {
    ($($ty:ty),*) => {$(
        impl PoolKey for $ty {
            fn key_bytes(&self) -> Cow<'_, [u8]> {
                let bytes: &[u8] = self;
                Cow::Borrowed(bytes)
            }
        }
    )*};
}

str_key!(String, &'static str, Arc<str>, Box<str>);
bytes_key!(Vec<u8>, Box<[u8]>, Arc<[u8]>, &'static [u8]);

macro_rules! int_key {
    ($($ty:ty),*) => {$(
        impl PoolKey for $ty {
            fn key_bytes(&self) -> Cow<'_, [u8]> {
                Cow::Owned(self.to_be_bytes().to_vec())
            }
        }
    )*};
}

int_key!(u8, u16, u32, u64, u128, usize, i8, i16, i32, i64, i128, isize);

#[cfg(test)]
mod tests {
    use super::*;

    /// Published FNV-1a 64 test vectors (the reference test suite by Fowler, Noll and Vo).
    #[test]
    fn known_vectors() {
        let vectors: [(&[u8], u64); 4] = [
            (b"", 0xcbf2_9ce4_8422_2325),
            (b"a", 0xaf63_dc4c_8601_ec8c),
            (b"b", 0xaf63_df4c_8601_f1a5),
            (b"foobar", 0x8594_4171_f739_67e8),
        ];
        for (input, expected) in vectors {
            assert_eq!(fnv1a64(input), expected, "{input:?}");
        }
    }
}
