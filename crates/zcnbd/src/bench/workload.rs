//! Running one cell: `jobs` threads, each with its own client, keeping `iodepth` requests in
//! flight for the cell's duration through the client's submit/complete API (buffers move
//! into each request and come back with its completion: no copies on the way).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use zcnbd_client::{Client, ClientOptions, Completion, WriteFlags};

use super::verify::Pattern;

/// An fio-style access pattern.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rw {
    Read,
    Write,
    RandRead,
    RandWrite,
    /// Random, half reads and half writes.
    RandMixed,
}

impl Rw {
    /// Parses fio's name.
    pub fn parse(s: &str) -> Option<Rw> {
        Some(match s {
            "read" => Rw::Read,
            "write" => Rw::Write,
            "randread" => Rw::RandRead,
            "randwrite" => Rw::RandWrite,
            "randrw" => Rw::RandMixed,
            _ => return None,
        })
    }

    /// fio's name.
    pub fn name(self) -> &'static str {
        match self {
            Rw::Read => "read",
            Rw::Write => "write",
            Rw::RandRead => "randread",
            Rw::RandWrite => "randwrite",
            Rw::RandMixed => "randrw",
        }
    }

    fn random(self) -> bool {
        matches!(self, Rw::RandRead | Rw::RandWrite | Rw::RandMixed)
    }
}

/// One cell's parameters.
#[derive(Clone)]
pub struct CellPlan {
    pub uri: String,
    pub rw: Rw,
    pub bs: u64,
    pub iodepth: u32,
    pub jobs: u32,
    pub connections: u32,
    pub runtime: Duration,
    /// Bytes of the export the cell touches, from offset 0.
    pub region: u64,
    /// Check every block read against the pattern (and write the pattern).
    pub verify: Option<Arc<Pattern>>,
}

/// What the jobs of one cell did together.
pub struct Measured {
    pub ops: u64,
    pub bytes: u64,
    pub elapsed: Duration,
    /// Completion latencies, nanoseconds.
    pub latency: Histogram<u64>,
    pub errors: u64,
    pub verify_errors: u64,
    /// The first error seen, for the report.
    pub first_error: Option<String>,
}

/// A small, fast generator for offsets (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// Where one job's requests go.
struct Offsets {
    rng: Rng,
    blocks: u64,
    bs: u64,
    next_seq: u64,
    random: bool,
}

impl Offsets {
    fn next(&mut self) -> u64 {
        let block = if self.random {
            self.rng.next() % self.blocks
        } else {
            let b = self.next_seq % self.blocks;
            self.next_seq += 1;
            b
        };
        block * self.bs
    }
}

/// Runs the cell; `stop` ends it early (Ctrl-C).
pub fn run(plan: &CellPlan, stop: &AtomicBool) -> Result<Measured, zcnbd_client::Error> {
    let options = ClientOptions {
        connections: plan.connections.max(1) as usize,
        ..ClientOptions::default()
    };
    // Connect every job first: connecting is not part of the measurement.
    let clients = (0..plan.jobs.max(1))
        .map(|_| Client::connect_with(&plan.uri, &options))
        .collect::<Result<Vec<_>, _>>()?;
    let start = Instant::now();
    let results: Vec<Measured> = std::thread::scope(|scope| {
        let handles: Vec<_> = clients
            .iter()
            .enumerate()
            .map(|(j, client)| scope.spawn(move || job(plan, client, j as u64, start, stop)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| failed_job("a job panicked")))
            .collect()
    });
    let elapsed = start.elapsed();
    let mut total = empty_measure();
    for m in results {
        total.ops += m.ops;
        total.bytes += m.bytes;
        total.errors += m.errors;
        total.verify_errors += m.verify_errors;
        total.first_error = total.first_error.or(m.first_error);
        let _ = total.latency.add(&m.latency);
    }
    total.elapsed = elapsed;
    Ok(total)
}

fn new_histogram() -> Histogram<u64> {
    // 1 ns to 60 s with 3 significant digits; these bounds are valid, so this cannot fail.
    Histogram::new_with_bounds(1, 60_000_000_000, 3).unwrap_or_else(|_| unreachable!())
}

fn empty_measure() -> Measured {
    Measured {
        ops: 0,
        bytes: 0,
        elapsed: Duration::ZERO,
        latency: new_histogram(),
        errors: 0,
        verify_errors: 0,
        first_error: None,
    }
}

fn failed_job(why: &str) -> Measured {
    Measured {
        errors: 1,
        first_error: Some(why.to_string()),
        ..empty_measure()
    }
}

/// One job's requests in flight: where each went and when.
struct Slots {
    offsets: Offsets,
    issued_at: Vec<Instant>,
    offset_of: Vec<u64>,
    read_next: bool,
}

impl Slots {
    /// Submits the next request of `plan` on `slot`, with `buffer`.
    fn submit(
        &mut self,
        plan: &CellPlan,
        client: &Client,
        slot: usize,
        mut buffer: Vec<u8>,
        m: &mut Measured,
    ) {
        let offset = self.offsets.next();
        let is_read = match plan.rw {
            Rw::Read | Rw::RandRead => true,
            Rw::Write | Rw::RandWrite => false,
            Rw::RandMixed => {
                self.read_next = !self.read_next;
                self.read_next
            }
        };
        self.offset_of[slot] = offset;
        // The user data carries the slot and whether it was a read.
        let user_data = (slot as u64) << 1 | u64::from(is_read);
        self.issued_at[slot] = Instant::now();
        let result = if is_read {
            client.submit_read(buffer, offset, user_data)
        } else {
            if let Some(p) = &plan.verify {
                p.fill(&mut buffer, offset);
            }
            client.submit_write(buffer, offset, WriteFlags::default(), user_data)
        };
        if let Err(e) = result {
            m.errors += 1;
            m.first_error.get_or_insert(e.to_string());
        }
    }
}

/// One job: keeps `iodepth` requests in flight until the runtime is over.
/// Counts completion `c` (its latency, bytes or error; a read checked when verifying).
fn record(plan: &CellPlan, slots: &Slots, c: &Completion, now: Instant, m: &mut Measured) {
    let slot = (c.user_data >> 1) as usize;
    let is_read = c.user_data & 1 == 1;
    let ns = now.duration_since(slots.issued_at[slot]).as_nanos() as u64;
    let _ = m.latency.record(ns.max(1));
    match &c.result {
        Ok(_) => {
            m.ops += 1;
            m.bytes += plan.bs;
            if let (true, Some(p)) = (is_read, &plan.verify) {
                m.verify_errors += p.check(&c.buffer, slots.offset_of[slot]);
            }
        }
        Err(e) => {
            m.errors += 1;
            m.first_error.get_or_insert(e.to_string());
        }
    }
}

fn job(
    plan: &CellPlan,
    client: &Client,
    index: u64,
    start: Instant,
    stop: &AtomicBool,
) -> Measured {
    let mut m = empty_measure();
    let blocks = (plan.region / plan.bs).max(1);
    let jobs = u64::from(plan.jobs.max(1));
    let depth = plan.iodepth.max(1) as usize;
    let mut slots = Slots {
        offsets: Offsets {
            rng: Rng(0x9e37_79b9_7f4a_7c15 ^ (index + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9)),
            blocks,
            bs: plan.bs,
            next_seq: index * blocks / jobs,
            random: plan.rw.random(),
        },
        issued_at: vec![start; depth],
        offset_of: vec![0; depth],
        read_next: false,
    };
    let deadline = start + plan.runtime;
    let mut in_flight = 0;
    // Requests submitted together leave together (one send; under TLS, shared records).
    let plug = client.plug();
    for slot in 0..depth {
        slots.submit(plan, client, slot, vec![0u8; plan.bs as usize], &mut m);
        in_flight += 1;
    }
    drop(plug);
    let mut done: Vec<Completion> = Vec::with_capacity(depth);
    while in_flight > 0 && m.errors == 0 {
        let got = client.complete(&mut done, Some(Duration::from_secs(5)));
        let now = Instant::now();
        if got == 0 && now > deadline + Duration::from_secs(30) {
            m.errors += 1;
            m.first_error
                .get_or_insert("requests did not complete in 30 s".into());
            break;
        }
        let finishing = now >= deadline || stop.load(Ordering::Relaxed);
        let plug = client.plug();
        for c in done.drain(..) {
            in_flight -= 1;
            let slot = (c.user_data >> 1) as usize;
            record(plan, &slots, &c, now, &mut m);
            if !finishing && m.errors == 0 {
                slots.submit(plan, client, slot, c.buffer, &mut m);
                in_flight += 1;
            }
        }
        drop(plug);
    }
    m
}
