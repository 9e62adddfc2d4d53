//! The kill -9 harness of `JetStreamQueue`, on a `nats-server` of its own (a free port, its own
//! store directory): 100 cycles in which a producer process (a channel spilling into the queue)
//! and a consumer process (the queue's reader) are started and each killed with SIGKILL at a
//! random moment; half way through, NATS itself is restarted under them. Then the backlog is
//! drained.
//!
//! Invariants: every record whose append the producer saw acknowledged (it printed `ACK n`) is
//! delivered at least once (a consumer printed `GOT n`, before acknowledging it); nothing is
//! delivered that was never appended.
//!
//! A plain `main` (harness = false): a child is this binary with `LANES_NATS_CHILD` set.

use std::collections::BTreeSet;
use std::io::Read;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lanes::channel::{BinaryCodec, Channel, ChannelConfig, Codec, Emitted, Overflow};
use lanes_nats::{JetStreamOptions, JetStreamQueue};

const CYCLES: u64 = 100;
const STREAM: &str = "LANES_KILL";
/// Records a producer appends per cycle at most (then it idles until killed).
const PER_CYCLE: u64 = 400;

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    match std::env::var("LANES_NATS_CHILD").as_deref() {
        Ok("produce") => runtime.block_on(produce()),
        Ok("consume") => runtime.block_on(consume()),
        Ok(other) => panic!("unknown child mode {other}"),
        Err(_) => {
            println!("test acknowledged_records_survive_kill_9_and_a_nats_restart ...");
            let nats = DedicatedNats::start();
            runtime.block_on(harness(nats));
            println!("test acknowledged_records_survive_kill_9_and_a_nats_restart ... ok");
        }
    }
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is set for children"))
}

async fn open(url: &str) -> JetStreamQueue {
    let options = async_nats::ConnectOptions::new().retry_on_initial_connect();
    let client = options.connect(url).await.expect("connect to the dedicated nats-server");
    let options = JetStreamOptions::default().publish_timeout(Duration::from_secs(10));
    loop {
        // Right after a restart, JetStream may not be ready yet.
        match JetStreamQueue::open(client.clone(), STREAM, options.clone()).await {
            Ok(queue) => return queue,
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// Child: emits numbered records into a channel of one slot that spills into the queue; prints
/// `ACK n` once a record's append is acknowledged (the emit returned `Spilled`).
async fn produce() {
    let queue = open(&env("NATS_KILL_URL")).await;
    let start: u64 = env("NATS_KILL_START").parse().unwrap();
    let channel =
        Channel::new(ChannelConfig::new(1).overflow(Overflow::spill(queue, BinaryCodec::new())))
            .unwrap();
    for n in start..start + PER_CYCLE {
        match channel.emit(n).await {
            Ok(Emitted::Spilled) => println!("ACK {n}"),
            Ok(_) => {} // kept in the channel's memory: never acknowledged as durable
            Err(err) => eprintln!("producer: {n}: {err}"),
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    tokio::time::sleep(Duration::from_secs(3600)).await;
}

/// Child: reads the queue, prints `GOT n`, then acknowledges.
async fn consume() {
    let queue = open(&env("NATS_KILL_URL")).await;
    let mut reader = loop {
        match queue.reader("kill", Duration::from_millis(800), 64).await {
            Ok(reader) => break reader,
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    loop {
        match reader.next(Duration::from_millis(200)).await {
            Ok(Some(delivery)) => {
                println!("GOT {}", decode(delivery.payload()));
                let _ = delivery.ack().await;
            }
            Ok(None) => {}
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

fn decode(bytes: &[u8]) -> u64 {
    Codec::<u64>::decode(&BinaryCodec::new(), bytes).expect("a record of the harness")
}

fn child(mode: &str, url: &str, start: u64) -> Child {
    Command::new(std::env::current_exe().expect("this binary"))
        .env("LANES_NATS_CHILD", mode)
        .env("NATS_KILL_URL", url)
        .env("NATS_KILL_START", start.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn a child")
}

/// Kills `child` with SIGKILL and returns the numbers it printed after `tag`.
fn kill_and_read(mut child: Child, tag: &str) -> Vec<u64> {
    let _ = child.kill();
    let _ = child.wait();
    let mut out = String::new();
    child.stdout.take().expect("piped").read_to_string(&mut out).expect("read the child");
    out.lines().filter_map(|line| line.strip_prefix(tag)?.trim().parse().ok()).collect()
}

/// A small random number generator (xorshift), seeded from the clock.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

async fn harness(mut nats: DedicatedNats) {
    let url = nats.url();
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
    let mut rng = Rng(u64::from(seed.subsec_nanos()) | 1);
    let (mut acked, mut got) = (BTreeSet::new(), BTreeSet::new());
    let mut deliveries = 0usize;
    let started = Instant::now();
    for cycle in 0..CYCLES {
        let producer = child("produce", &url, cycle * 1_000_000);
        let consumer = child("consume", &url, 0);
        let (kill_producer, kill_consumer) = (100 + rng.below(300), 100 + rng.below(300));
        if cycle == CYCLES / 2 {
            // NATS goes away under both, and comes back on the same store.
            tokio::time::sleep(Duration::from_millis(150)).await;
            nats.restart();
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let (first, second) = (kill_producer.min(kill_consumer), kill_producer.max(kill_consumer));
        tokio::time::sleep(Duration::from_millis(first)).await;
        let (producer, consumer) = if kill_producer <= kill_consumer {
            acked.extend(kill_and_read(producer, "ACK "));
            (None, Some(consumer))
        } else {
            let printed = kill_and_read(consumer, "GOT ");
            deliveries += printed.len();
            got.extend(printed);
            (Some(producer), None)
        };
        tokio::time::sleep(Duration::from_millis(second - first)).await;
        if let Some(producer) = producer {
            acked.extend(kill_and_read(producer, "ACK "));
        }
        if let Some(consumer) = consumer {
            let printed = kill_and_read(consumer, "GOT ");
            deliveries += printed.len();
            got.extend(printed);
        }
    }
    // Drain what is left, in this process, until nothing comes for two redelivery periods.
    let queue = open(&url).await;
    let mut reader = queue.reader("kill", Duration::from_millis(800), 64).await.unwrap();
    let mut drained = 0usize;
    while let Some(delivery) = reader.next(Duration::from_secs(2)).await.unwrap() {
        got.insert(decode(delivery.payload()));
        drained += 1;
        delivery.ack().await.unwrap();
    }
    let lost: Vec<u64> = acked.difference(&got).copied().collect();
    println!(
        "{CYCLES} cycles in {:?}: {} acknowledged appends, {} distinct records delivered \
         ({deliveries} deliveries by killed consumers, {drained} in the drain), {} lost",
        started.elapsed(),
        acked.len(),
        got.len(),
        lost.len()
    );
    assert!(acked.len() >= CYCLES as usize * 10, "the producers appended: {}", acked.len());
    assert!(lost.is_empty(), "acknowledged records never delivered: {lost:?}");
    let never_appended: Vec<&u64> = got.iter().filter(|n| **n % 1_000_000 >= PER_CYCLE).collect();
    assert!(never_appended.is_empty(), "delivered records nobody appended: {never_appended:?}");
    assert_eq!(queue.stored().await.unwrap(), 0, "the drained queue is empty");
}

/// A `nats-server` with JetStream of our own on a free port, with its own store directory.
struct DedicatedNats {
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl DedicatedNats {
    fn start() -> Self {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let dir =
            std::env::temp_dir().join(format!("lanes-nats-kill-{}-{port}", std::process::id()));
        let mut nats = Self { port, dir, child: None };
        nats.spawn();
        nats
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    fn spawn(&mut self) {
        let binary = std::env::var("NATS_SERVER").unwrap_or_else(|_| {
            if std::path::Path::new("/usr/sbin/nats-server").exists() {
                "/usr/sbin/nats-server".to_owned()
            } else {
                "nats-server".to_owned()
            }
        });
        let child = Command::new(&binary)
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string(), "-js", "-sd"])
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot run {binary} ({e}): install nats-server or set NATS_SERVER")
            });
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(Instant::now() < deadline, "the dedicated nats-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops the server (SIGTERM: it flushes its store) and starts it again on the same store.
    fn restart(&mut self) {
        self.stop();
        self.spawn();
    }

    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
            let deadline = Instant::now() + Duration::from_secs(10);
            while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for DedicatedNats {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
