//! A keyed pool: each account's events are processed one at a time and in order, different
//! accounts in parallel. `cargo run -p lanes --example keyed_pool`

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lanes::pool::KeyedPool;

#[tokio::main]
pub(crate) async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let ledger: Arc<Mutex<BTreeMap<String, Vec<u32>>>> = Arc::default();
    let pool = {
        let ledger = ledger.clone();
        KeyedPool::builder()
            .workers(4)
            .queue_size(256)
            .key_of(|event: &(String, u32)| event.0.clone())
            .build(move |_, (account, seq): (String, u32)| {
                let ledger = ledger.clone();
                async move {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    ledger.lock().expect("ledger").entry(account).or_default().push(seq);
                    Ok::<_, std::io::Error>(())
                }
            })?
    };
    for seq in 0..20 {
        for account in ["alice", "bob", "carol"] {
            // Waits for room when the queue is full.
            pool.submit_wait((account.to_owned(), seq)).await?;
        }
    }
    pool.stop(Duration::from_secs(10)).await?;
    let ledger = ledger.lock().expect("ledger");
    for (account, seqs) in ledger.iter() {
        assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{account} out of order");
        println!("{account}: {} events, in order", seqs.len());
    }
    Ok(())
}
