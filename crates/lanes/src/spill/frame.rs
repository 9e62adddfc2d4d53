//! Frames: how one record is laid out in a segment, and how a scan finds them again.
//!
//! ```text
//! offset  size  field
//! 0       4     len           payload length, u32 little-endian
//! 4       4     payload_crc   CRC32C of the payload, u32 little-endian
//! 8       4     header_crc    CRC32C of bytes 0..8, u32 little-endian
//! 12      len   payload
//! ```
//!
//! The header CRC lets a scan reject a false frame start after reading 12 bytes, so skipping a
//! corrupt region costs one pass over it, not one payload-sized check per byte.

use std::io;

/// Bytes before the payload.
pub(crate) const HEADER: usize = 12;

/// The high bit of a frame's `len` marks a control frame rather than a record; records are
/// below 2 GiB. The one control frame is the seal: payload 8 bytes, the segment's data length
/// before the seal (the seal's own offset), written when the writer moves to the next segment.
pub(crate) const SEAL_FLAG: u32 = 1 << 31;

/// Bytes of a seal frame.
pub(crate) const SEAL_LEN: u64 = HEADER as u64 + 8;

/// Appends the seal of a segment whose data ends at `data_end` (a file offset) to `out`.
pub(crate) fn encode_seal(data_end: u64, out: &mut Vec<u8>) {
    let payload = data_end.to_le_bytes();
    let mut head = [0u8; HEADER];
    head[0..4].copy_from_slice(&(SEAL_FLAG | 8).to_le_bytes());
    head[4..8].copy_from_slice(&crc32c::crc32c(&payload).to_le_bytes());
    let header_crc = crc32c::crc32c(&head[0..8]);
    head[8..12].copy_from_slice(&header_crc.to_le_bytes());
    out.extend_from_slice(&head);
    out.extend_from_slice(&payload);
}

/// A frame's header, decoded and checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub(crate) len: u32,
    pub(crate) payload_crc: u32,
    /// A seal (control frame), not a record.
    pub(crate) seal: bool,
}

/// Appends the frame of `payload` to `out`.
pub(crate) fn encode(payload: &[u8], out: &mut Vec<u8>) {
    let len = u32::try_from(payload.len()).expect("records are bounded below 4 GiB");
    let mut head = [0u8; HEADER];
    head[0..4].copy_from_slice(&len.to_le_bytes());
    head[4..8].copy_from_slice(&crc32c::crc32c(payload).to_le_bytes());
    let header_crc = crc32c::crc32c(&head[0..8]);
    head[8..12].copy_from_slice(&header_crc.to_le_bytes());
    out.extend_from_slice(&head);
    out.extend_from_slice(payload);
}

/// Decodes a header from the first 12 bytes of `bytes`, if they are a valid header whose
/// payload fits `max_len`.
pub(crate) fn header(bytes: &[u8], max_len: u32) -> Option<Header> {
    let head: &[u8; HEADER] = bytes.get(..HEADER)?.try_into().ok()?;
    let word = |i: usize| u32::from_le_bytes([head[i], head[i + 1], head[i + 2], head[i + 3]]);
    if crc32c::crc32c(&head[0..8]) != word(8) {
        return None;
    }
    let raw = word(0);
    let seal = raw & SEAL_FLAG != 0;
    let len = raw & !SEAL_FLAG;
    if seal {
        return (len == 8).then_some(Header { len, payload_crc: word(4), seal });
    }
    (len <= max_len).then_some(Header { len, payload_crc: word(4), seal })
}

/// Whether `payload` matches the header's checksum.
pub(crate) fn payload_ok(header: Header, payload: &[u8]) -> bool {
    payload.len() == header.len as usize && crc32c::crc32c(payload) == header.payload_crc
}

/// What a scan found at one point of a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scanned {
    /// A whole valid frame of `len` bytes.
    Frame { len: u64 },
    /// A whole valid seal; the data before it ended at `data_end`.
    Seal { data_end: u64 },
    /// Not a valid frame start.
    Invalid,
    /// A valid header whose payload runs past the end of the buffer.
    Short,
}

/// Looks at `bytes` as the start of a frame.
pub(crate) fn scan_at(bytes: &[u8], max_len: u32) -> Scanned {
    if bytes.len() < HEADER {
        return Scanned::Short;
    }
    let Some(header) = header(bytes, max_len) else {
        return Scanned::Invalid;
    };
    let end = HEADER + header.len as usize;
    match bytes.get(HEADER..end) {
        None => Scanned::Short,
        Some(payload) if payload_ok(header, payload) && header.seal => {
            let data_end = u64::from_le_bytes(payload.try_into().expect("8 bytes"));
            Scanned::Seal { data_end }
        }
        Some(payload) if payload_ok(header, payload) => Scanned::Frame { len: end as u64 },
        Some(_) => Scanned::Invalid,
    }
}

/// The result of scanning a segment's bytes after its header, in memory: the model a streamed
/// scan ([`scan_stream`]) is tested against.
#[cfg(test)]
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Layout {
    /// Start offsets (relative to the scanned bytes) and lengths of the valid frames.
    pub(crate) frames: Vec<(u64, u64)>,
    /// Corrupt regions skipped in the middle: (start, end).
    pub(crate) skipped: Vec<(u64, u64)>,
    /// Where the valid data ends: everything after is a torn or corrupt tail.
    pub(crate) valid_end: u64,
    /// The seal, if the segment has one: (its start, relative to the scanned bytes; the data
    /// end it records, a file offset). Nothing valid follows a seal.
    pub(crate) seal: Option<(u64, u64)>,
}

#[cfg(test)]
impl Layout {
    /// Bytes of the torn or corrupt tail, given the scanned bytes: everything after the valid
    /// data but the zeros that end it (space reserved and never written, see
    /// `AppendFile::reserve`).
    pub(crate) fn tail(&self, scanned: &[u8]) -> u64 {
        let after = &scanned[(self.valid_end as usize).min(scanned.len())..];
        let zeros = after.iter().rev().take_while(|b| **b == 0).count();
        (after.len() - zeros) as u64
    }
}

/// Scans `bytes`: every valid frame in order, skipping corrupt regions up to the next valid
/// frame. Each step advances by at least one byte, so a scan always ends.
#[cfg(test)]
pub(crate) fn scan(bytes: &[u8], max_len: u32) -> Layout {
    let mut layout = Layout::default();
    let mut at = 0usize;
    let mut corrupt_from: Option<usize> = None;
    while at < bytes.len() {
        match scan_at(&bytes[at..], max_len) {
            Scanned::Frame { len } => {
                if let Some(start) = corrupt_from.take() {
                    layout.skipped.push((start as u64, at as u64));
                }
                layout.frames.push((at as u64, len));
                at += len as usize;
                layout.valid_end = at as u64;
            }
            Scanned::Seal { data_end } => {
                if let Some(start) = corrupt_from.take() {
                    layout.skipped.push((start as u64, at as u64));
                }
                layout.seal = Some((at as u64, data_end));
                layout.valid_end = at as u64 + SEAL_LEN;
                // Whatever follows a seal is not the segment's: a tail.
                break;
            }
            Scanned::Invalid | Scanned::Short => {
                corrupt_from.get_or_insert(at);
                // A header is never twelve zero bytes (its checksum of zeros is not zero), so a
                // run of zeros (reserved, never written space) is skipped up to the twelve
                // bytes before its end, not byte by byte.
                let zeros = bytes[at..].iter().take_while(|b| **b == 0).count();
                at += zeros.saturating_sub(HEADER - 1).max(1);
            }
        }
    }
    layout
}

/// Reads bytes of one file at an offset: fills the buffer, short only at the file's end.
pub(crate) type ReadAt<'a> = dyn FnMut(u64, &mut [u8]) -> io::Result<usize> + 'a;

/// What a streamed scan found. Its frames went to the scan's visitor one by one (a file of
/// many frames costs no memory per frame); offsets are relative to the scanned bytes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Streamed {
    /// Valid frames found.
    pub(crate) frames: u64,
    /// Corrupt regions skipped in the middle: (start, end).
    pub(crate) skipped: Vec<(u64, u64)>,
    /// Where the valid data ends: everything after is a torn or corrupt tail.
    pub(crate) valid_end: u64,
    /// The seal, if the segment has one: (its start; the data end it records, a file offset).
    /// Nothing valid follows a seal.
    pub(crate) seal: Option<(u64, u64)>,
    /// Bytes of the torn or corrupt tail: everything after the valid data but the zeros that
    /// end it (space reserved and never written, see `AppendFile::reserve`).
    pub(crate) tail: u64,
    /// The bytes scanned (the file's length, or less if it shrank under the scan).
    pub(crate) len: u64,
}

/// A window of at most `cap` bytes over a file read in pieces.
struct Window<'r, 'a> {
    read: &'r mut ReadAt<'a>,
    /// Where the file ends (moved in if a read comes back short: it shrank).
    len: u64,
    buf: Vec<u8>,
    /// The file offset of `buf[0]`.
    start: u64,
    cap: usize,
}

impl<'r, 'a> Window<'r, 'a> {
    /// The bytes from `at` on: at least `n` of them (`n <= cap`), or all up to the end.
    fn at(&mut self, at: u64, n: usize) -> io::Result<&[u8]> {
        let want = (n as u64).min(self.len.saturating_sub(at));
        let end = self.start + self.buf.len() as u64;
        if at < self.start || at + want > end {
            let fill = (self.cap as u64).min(self.len.saturating_sub(at)) as usize;
            self.buf.resize(fill, 0);
            let mut got = 0;
            while got < fill {
                match (self.read)(at + got as u64, &mut self.buf[got..]) {
                    Ok(0) => break,
                    Ok(read) => got += read,
                    Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                    Err(err) => return Err(err),
                }
            }
            self.buf.truncate(got);
            self.start = at;
            if got < fill {
                self.len = at + got as u64;
            }
        }
        Ok(&self.buf[(at - self.start) as usize..])
    }

    /// How many zero bytes start at `at`.
    fn zeros_from(&mut self, mut at: u64) -> io::Result<u64> {
        let from = at;
        while at < self.len {
            // What the window holds from `at`: a new window only once it is used up (a step
            // over corrupt bytes calls this at every byte).
            let bytes = self.at(at, 1)?;
            if bytes.is_empty() {
                break;
            }
            let zeros = leading_zeros(bytes);
            at += zeros as u64;
            if zeros < bytes.len() {
                break;
            }
        }
        Ok(at - from)
    }

    /// Looks at `at` as the start of a frame, as [`scan_at`] does, reading what it needs: a
    /// payload longer than the window goes through the checksum piece by piece.
    fn scan_at(&mut self, at: u64, max_len: u32) -> io::Result<Scanned> {
        let head = self.at(at, HEADER)?;
        if head.len() < HEADER {
            return Ok(Scanned::Short);
        }
        let Some(header) = header(head, max_len) else {
            return Ok(Scanned::Invalid);
        };
        let total = HEADER as u64 + u64::from(header.len);
        if at + total > self.len {
            return Ok(Scanned::Short);
        }
        let (mut crc, mut off, end) = (0u32, at + HEADER as u64, at + total);
        let mut seal_payload = [0u8; 8];
        while off < end {
            let n = ((end - off) as usize).min(self.cap);
            let bytes = self.at(off, n)?;
            if bytes.len() < n {
                return Ok(Scanned::Short); // shrank under the scan
            }
            crc = crc32c::crc32c_append(crc, &bytes[..n]);
            if header.seal && off == at + HEADER as u64 && n == 8 {
                seal_payload.copy_from_slice(&bytes[..8]);
            }
            off += n as u64;
        }
        Ok(match (crc == header.payload_crc, header.seal) {
            (false, _) => Scanned::Invalid,
            (true, true) => Scanned::Seal { data_end: u64::from_le_bytes(seal_payload) },
            (true, false) => Scanned::Frame { len: total },
        })
    }

    /// Bytes in `[from, len)` but the zeros that end them.
    fn tail_after(&mut self, from: u64) -> io::Result<u64> {
        let mut end = self.len;
        while end > from {
            let start = end.saturating_sub(self.cap as u64).max(from);
            let bytes = self.at(start, (end - start) as usize)?;
            let piece = &bytes[..((end - start) as usize).min(bytes.len())];
            let zeros = trailing_zeros(piece);
            if zeros < piece.len() {
                return Ok(end - zeros as u64 - from);
            }
            end = start;
        }
        Ok(0)
    }
}

/// A block of zeros to compare with: a reserved tail or a sparse file is zeros for gigabytes,
/// and a comparison of slices (a `memcmp`) counts them far faster than byte by byte.
static ZEROS: [u8; 4096] = [0; 4096];

/// How many zero bytes start `bytes`.
fn leading_zeros(bytes: &[u8]) -> usize {
    let mut zeros = 0;
    for block in bytes.chunks(ZEROS.len()) {
        if block != &ZEROS[..block.len()] {
            return zeros + block.iter().take_while(|b| **b == 0).count();
        }
        zeros += block.len();
    }
    zeros
}

/// How many zero bytes end `bytes`.
fn trailing_zeros(bytes: &[u8]) -> usize {
    let mut zeros = 0;
    for block in bytes.rchunks(ZEROS.len()) {
        if block != &ZEROS[..block.len()] {
            return zeros + block.iter().rev().take_while(|b| **b == 0).count();
        }
        zeros += block.len();
    }
    zeros
}

/// The bytes a streamed scan reads at a time (and the most it holds).
pub(crate) const SCAN_WINDOW: usize = 256 << 10;

/// Scans `len` bytes read through `read` a window of `window` bytes at a time: every valid
/// frame in order, to `on_frame(start, len)`, skipping corrupt regions up to the next valid
/// frame. Each step advances by at least one byte, so a scan always ends; memory stays within
/// the window whatever the file holds. (Tested against an in-memory scan of the same bytes.)
pub(crate) fn scan_stream(
    read: &mut ReadAt<'_>,
    len: u64,
    max_len: u32,
    window: usize,
    mut on_frame: impl FnMut(u64, u64),
) -> io::Result<Streamed> {
    let cap = window.max(HEADER + 8);
    let mut w = Window { read, len, buf: Vec::new(), start: 0, cap };
    let mut out = Streamed::default();
    let mut at = 0u64;
    let mut corrupt_from: Option<u64> = None;
    while at < w.len {
        match w.scan_at(at, max_len)? {
            Scanned::Frame { len } => {
                if let Some(start) = corrupt_from.take() {
                    out.skipped.push((start, at));
                }
                on_frame(at, len);
                out.frames += 1;
                at += len;
                out.valid_end = at;
            }
            Scanned::Seal { data_end } => {
                if let Some(start) = corrupt_from.take() {
                    out.skipped.push((start, at));
                }
                out.seal = Some((at, data_end));
                out.valid_end = at + SEAL_LEN;
                break;
            }
            Scanned::Invalid | Scanned::Short => {
                corrupt_from.get_or_insert(at);
                let zeros = w.zeros_from(at)?;
                at += zeros.saturating_sub(HEADER as u64 - 1).max(1);
            }
        }
    }
    out.tail = w.tail_after(out.valid_end.min(w.len))?;
    out.len = w.len;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn crc32c_matches_the_standard_check_value() {
        // The check value of CRC-32C (Castagnoli) for "123456789".
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
    }

    #[test]
    fn frames_round_trip_and_resync_after_corruption() {
        let mut bytes = Vec::new();
        for payload in [&b"alpha"[..], b"", b"gamma!"] {
            encode(payload, &mut bytes);
        }
        let layout = scan(&bytes, 1024);
        assert_eq!(layout.frames.len(), 3);
        assert_eq!(layout.valid_end, bytes.len() as u64);
        // Corrupt the middle frame's payload: it is skipped, the third one is found.
        let second = layout.frames[1].0 as usize;
        let mut broken = bytes.clone();
        broken[second + 4] ^= 0xFF;
        let layout = scan(&broken, 1024);
        assert_eq!(layout.frames.len(), 2);
        assert_eq!(layout.skipped.len(), 1);
        // A torn tail: the last frame cut short.
        let cut = &bytes[..bytes.len() - 2];
        let layout = scan(cut, 1024);
        assert_eq!(layout.frames.len(), 2);
        assert_eq!(layout.tail(cut), cut.len() as u64 - layout.valid_end);
        // Zeroes (a preallocated or zero-filled tail) are not frames, nor a torn tail.
        assert!(scan(&[0u8; 64], 1024).frames.is_empty());
        let mut reserved = bytes.clone();
        reserved.resize(bytes.len() + 100_000, 0);
        let layout = scan(&reserved, 1024);
        assert_eq!((layout.frames.len(), layout.tail(&reserved)), (3, 0));
        // Garbage before the zeros is a torn tail all the same.
        let mut torn = bytes.clone();
        torn.extend_from_slice(&[7, 7, 7]);
        torn.resize(torn.len() + 50, 0);
        assert_eq!(scan(&torn, 1024).tail(&torn), 3);
        // A frame right after a run of zeros is still found.
        let mut gap = vec![0u8; 40];
        encode(b"after zeros", &mut gap);
        assert_eq!(scan(&gap, 1024).frames, vec![(40, 12 + 11)]);
        // A frame longer than the maximum is not accepted.
        assert!(scan(&bytes, 4).frames.iter().all(|(_, len)| *len <= 16));
    }

    /// A scan reads each byte about once, whatever it holds: a step over corrupt bytes (one
    /// at a time) uses what the window holds, rather than reading a window afresh (review
    /// finding, stop 75: 300 KB of garbage read 73 GiB).
    #[test]
    fn a_streamed_scan_reads_each_window_about_once() {
        let mut bytes = vec![0xA5u8; 1 << 20];
        encode(b"a frame after the garbage", &mut bytes);
        bytes.resize(bytes.len() + (1 << 20), 0);
        bytes.extend_from_slice(&[7u8; 1000]);
        let window = 4096;
        let (mut reads, mut read_bytes) = (0u64, 0u64);
        let mut read = |offset: u64, buf: &mut [u8]| {
            let start = (offset as usize).min(bytes.len());
            let n = buf.len().min(bytes.len() - start);
            buf[..n].copy_from_slice(&bytes[start..start + n]);
            reads += 1;
            read_bytes += n as u64;
            Ok(n)
        };
        let len = (2 << 20) + 12 + 25 + 1000;
        let streamed = scan_stream(&mut read, len, u32::MAX, window, |_, _| {}).unwrap();
        assert_eq!(streamed.frames, 1);
        // The scan forward, then the tail's backward: about two passes, not one a byte.
        assert!(read_bytes <= 3 * len, "{read_bytes} bytes read in {reads} reads for {len}");
        assert!(reads <= 3 * len / window as u64 + 16, "{reads} reads");
    }

    proptest! {
        /// The decoder never panics and always ends on arbitrary bytes, and every frame it
        /// reports is a valid frame inside the input.
        #[test]
        fn scanning_arbitrary_bytes_is_safe(bytes in proptest::collection::vec(any::<u8>(), 0..2048), max in 0u32..600) {
            let layout = scan(&bytes, max);
            let mut last_end = 0;
            for (start, len) in &layout.frames {
                prop_assert!(*start >= last_end);
                let end = (*start + *len) as usize;
                prop_assert!(end <= bytes.len());
                let is_frame = matches!(scan_at(&bytes[*start as usize..], max), Scanned::Frame { .. });
                prop_assert!(is_frame);
                last_end = end as u64;
            }
            prop_assert!(layout.valid_end <= bytes.len() as u64);
        }

        /// A streamed scan, whatever its window, finds what [`scan`] finds in the same bytes.
        #[test]
        fn a_streamed_scan_finds_what_a_scan_finds(
            payloads in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..80), 0..6),
            garbage in proptest::collection::vec((0usize..400, proptest::collection::vec(any::<u8>(), 1..24)), 0..4),
            zeros in 0usize..200,
            sealed in any::<bool>(),
            window in 20usize..120,
            max in prop_oneof![Just(u32::MAX), 0u32..100],
        ) {
            let mut bytes = Vec::new();
            for p in &payloads {
                encode(p, &mut bytes);
            }
            if sealed {
                encode_seal(bytes.len() as u64 + 16, &mut bytes);
            }
            bytes.resize(bytes.len() + zeros, 0);
            for (at, junk) in &garbage {
                let at = (*at).min(bytes.len());
                bytes.splice(at..at, junk.iter().copied());
            }
            let model = scan(&bytes, max);
            let mut frames = Vec::new();
            let mut read = |offset: u64, buf: &mut [u8]| {
                let start = (offset as usize).min(bytes.len());
                let n = buf.len().min(bytes.len() - start);
                buf[..n].copy_from_slice(&bytes[start..start + n]);
                Ok(n)
            };
            let streamed = scan_stream(&mut read, bytes.len() as u64, max, window, |start, len| {
                frames.push((start, len));
            })
            .unwrap();
            prop_assert_eq!(&frames, &model.frames);
            prop_assert_eq!(&streamed.skipped, &model.skipped);
            prop_assert_eq!(streamed.valid_end, model.valid_end);
            prop_assert_eq!(streamed.seal, model.seal);
            prop_assert_eq!(streamed.tail, model.tail(&bytes));
            prop_assert_eq!(streamed.frames, model.frames.len() as u64);
        }

        /// Valid frames with garbage around them are all found again.
        #[test]
        fn frames_survive_garbage_around_them(
            payloads in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..64), 1..8),
            garbage in proptest::collection::vec(any::<u8>(), 0..32),
        ) {
            let mut bytes = garbage.clone();
            for p in &payloads {
                encode(p, &mut bytes);
            }
            let layout = scan(&bytes, 1 << 20);
            let found: Vec<Vec<u8>> = layout
                .frames
                .iter()
                .map(|(s, l)| bytes[(*s as usize + HEADER)..(*s + *l) as usize].to_vec())
                .collect();
            // Garbage could by chance hold a frame; the real ones are the last ones found.
            prop_assert!(found.len() >= payloads.len());
            prop_assert_eq!(&found[found.len() - payloads.len()..], &payloads[..]);
        }
    }
}
