//! File names, the segment header and the state (manifest) file. See `FORMAT.md` beside this
//! module for the whole on-disk format.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The on-disk format version, 2: segments are sealed when the writer moves on (a seal frame
/// records the data length), and the state file records the highest segment id ever created.
/// Version 1 segments and state files are read too.
pub const FORMAT_VERSION: u16 = 2;

/// The lock file: held (advisory `flock`) by the process that owns the queue.
pub(crate) const LOCK: &str = "LOCK";
/// The state file: the committed position.
pub(crate) const STATE: &str = "STATE";

const SEGMENT_MAGIC: [u8; 4] = *b"LSEG";
const STATE_MAGIC: [u8; 4] = *b"LSPQ";

/// Bytes of a segment header.
pub(crate) const SEGMENT_HEADER: u64 = 16;
const STATE_LEN_V1: usize = 28;
const STATE_LEN: usize = 36;

/// A place in the queue: a segment and a byte offset in it. Positions order records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Position {
    /// The segment's id (its file is `{segment:020}.seg`).
    pub segment: u64,
    /// A byte offset in the segment file, at a frame boundary.
    pub offset: u64,
}

impl Position {
    /// The first record's place in segment `segment`.
    pub(crate) fn start_of(segment: u64) -> Self {
        Self { segment, offset: SEGMENT_HEADER }
    }
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.segment, self.offset)
    }
}

/// The file name of segment `id`.
pub(crate) fn segment_name(id: u64) -> String {
    format!("{id:020}.seg")
}

/// The id of a segment file name, if `name` is one.
pub(crate) fn segment_id(name: &str) -> Option<u64> {
    let digits = name.strip_suffix(".seg")?;
    (digits.len() == 20 && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse().ok())?
}

/// The header of segment `id`.
pub(crate) fn segment_header(id: u64) -> [u8; SEGMENT_HEADER as usize] {
    segment_header_of(id, FORMAT_VERSION)
}

/// The header of segment `id` in format `version` (a repair writes a damaged one again in the
/// version its segment was written in).
pub(crate) fn segment_header_of(id: u64, version: u16) -> [u8; SEGMENT_HEADER as usize] {
    let mut header = [0u8; SEGMENT_HEADER as usize];
    header[0..4].copy_from_slice(&SEGMENT_MAGIC);
    header[4..6].copy_from_slice(&version.to_le_bytes());
    header[8..16].copy_from_slice(&id.to_le_bytes());
    header
}

/// The format version of segment `id`'s header at the start of `bytes`, if it is one (1 or 2).
pub(crate) fn segment_version(bytes: &[u8], id: u64) -> Option<u16> {
    let header = bytes.get(..SEGMENT_HEADER as usize)?;
    let version = u16::from_le_bytes([header[4], header[5]]);
    let mut expected = segment_header(id);
    expected[4..6].copy_from_slice(&version.to_le_bytes());
    ((version == 1 || version == FORMAT_VERSION) && header == expected).then_some(version)
}

/// Whether `bytes` start with the header of segment `id` (any version this code reads).
pub(crate) fn segment_header_ok(bytes: &[u8], id: u64) -> bool {
    segment_version(bytes, id).is_some()
}

/// The state file's bytes: the committed position and the highest segment id ever created
/// (so recovery can tell a deleted last segment from one never written).
pub(crate) fn encode_state(committed: Position, last: u64) -> [u8; STATE_LEN] {
    let mut out = [0u8; STATE_LEN];
    out[0..4].copy_from_slice(&STATE_MAGIC);
    out[4..6].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    out[8..16].copy_from_slice(&committed.segment.to_le_bytes());
    out[16..24].copy_from_slice(&committed.offset.to_le_bytes());
    out[24..32].copy_from_slice(&last.to_le_bytes());
    let crc = crc32c::crc32c(&out[0..32]);
    out[32..36].copy_from_slice(&crc.to_le_bytes());
    out
}

/// A state file's contents, if it is valid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct State {
    pub(crate) committed: Position,
    /// The highest segment id ever created (version 2 and later).
    pub(crate) last: Option<u64>,
}

/// The state file's state, read without trusting its size: a file longer than any state is
/// not one (`None`, as unreadable), and is not read.
pub(crate) fn read_state(storage: &dyn super::storage::Storage) -> std::io::Result<Option<State>> {
    if storage.len(STATE)? > STATE_LEN as u64 {
        return Ok(None);
    }
    Ok(decode_state(&storage.read_all(STATE)?))
}

/// The committed position (and, from version 2, the last segment id) in a state file.
pub(crate) fn decode_state(bytes: &[u8]) -> Option<State> {
    let u64_at = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().expect("8 bytes"));
    let u32_at = |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().expect("4 bytes"));
    if bytes.len() < 6 || bytes[0..4] != STATE_MAGIC {
        return None;
    }
    match (u16::from_le_bytes([bytes[4], bytes[5]]), bytes.len()) {
        (1, STATE_LEN_V1) => (crc32c::crc32c(&bytes[0..24]) == u32_at(24)).then(|| State {
            committed: Position { segment: u64_at(8), offset: u64_at(16) },
            last: None,
        }),
        (2, STATE_LEN) => (crc32c::crc32c(&bytes[0..32]) == u32_at(32)).then(|| State {
            committed: Position { segment: u64_at(8), offset: u64_at(16) },
            last: Some(u64_at(24)),
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_headers_and_state_round_trip() {
        assert_eq!(segment_name(7), "00000000000000000007.seg");
        assert_eq!(segment_id("00000000000000000007.seg"), Some(7));
        assert_eq!(segment_id("7.seg"), None);
        assert_eq!(segment_id("0000000000000000000x.seg"), None);
        assert!(segment_header_ok(&segment_header(9), 9));
        assert!(!segment_header_ok(&segment_header(9), 8));
        let position = Position { segment: 3, offset: 1234 };
        let state = encode_state(position, 9);
        assert_eq!(decode_state(&state), Some(State { committed: position, last: Some(9) }));
        let mut broken = state;
        broken[10] ^= 1;
        assert_eq!(decode_state(&broken), None);
        assert_eq!(decode_state(&state[..20]), None);
        // Version 1 state files (no last segment id) are still read.
        let mut v1 = [0u8; STATE_LEN_V1];
        v1[0..4].copy_from_slice(&STATE_MAGIC);
        v1[4..6].copy_from_slice(&1u16.to_le_bytes());
        v1[8..16].copy_from_slice(&3u64.to_le_bytes());
        v1[16..24].copy_from_slice(&1234u64.to_le_bytes());
        let crc = crc32c::crc32c(&v1[0..24]);
        v1[24..28].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(decode_state(&v1), Some(State { committed: position, last: None }));
    }
}
