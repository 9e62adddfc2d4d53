//! Dynamic channels allocate no buffer until their first emit: thousands of idle channels cost
//! little memory. Alone in its binary so other tests do not disturb the measurement.

use lanes::channel::{ChannelConfig, Channels};

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("Linux /proc");
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

#[tokio::test]
async fn idle_dynamic_channels_allocate_no_buffer() {
    const CHANNELS: usize = 20_000;
    let channels = Channels::with_budget(1_000_000).unwrap();
    let before = rss_bytes();
    let mut handles = Vec::with_capacity(CHANNELS);
    for n in 0..CHANNELS {
        // Default capacity 512 records of 256 bytes: 128 KiB each if buffers were reserved.
        let channel = channels
            .get_or_create::<[u8; 256]>(&format!("session-{n}"), ChannelConfig::default())
            .unwrap();
        assert_eq!(channel.capacity(), 512);
        handles.push(channel);
    }
    let grown = rss_bytes().saturating_sub(before);
    let per_channel = grown / CHANNELS as u64;
    // A channel takes under 1 KiB; a reserved buffer would add 128 KiB of address space, of
    // which the allocator touches (and RSS shows) several KiB.
    assert!(per_channel < 2048, "{per_channel} bytes per idle channel");

    // The first emit allocates a small buffer, not the whole capacity.
    let before = rss_bytes();
    for channel in handles.iter().take(2_000) {
        channel.try_emit([7; 256]).unwrap();
    }
    let per_channel = rss_bytes().saturating_sub(before) / 2_000;
    assert!(per_channel < 16 * 1024, "{per_channel} bytes per channel after one emit");
    assert_eq!(channels.budget_used(), Some(2_000));
}
