//! The KV link of a node in virtual time: a fixed latency per transfer, then
//! processor sharing of the bandwidth among the transfers in flight.
//!
//! With one transfer this is Equation 2 of the paper (B/β); with many, each
//! gets β/n, so transfers queue and slow down under load as on a real link.

use crate::profile::LinkModel;

#[derive(Debug, Clone)]
struct Transfer {
    id: u64,
    /// Until then the transfer pays its latency and uses no bandwidth.
    start_at: f64,
    remaining: f64,
}

#[derive(Debug, Clone)]
pub struct Link {
    model: LinkModel,
    bytes_per_ms: f64,
    now: f64,
    active: Vec<Transfer>,
    /// Bytes moved so far (for metrics).
    pub bytes_done: u64,
}

impl Link {
    pub fn new(model: LinkModel) -> Link {
        Link {
            model,
            bytes_per_ms: model.gbps * 1e6,
            now: 0.0,
            active: Vec::new(),
            bytes_done: 0,
        }
    }

    /// Bytes still to move over the link (transfers started or queued).
    pub fn bytes_in_flight(&self) -> u64 {
        self.active.iter().map(|x| x.remaining as u64).sum()
    }

    pub fn in_flight(&self) -> usize {
        self.active.len()
    }

    /// Starts a transfer of `bytes` at `now` (after [`advance`](Self::advance) to `now`).
    pub fn start(&mut self, now: f64, id: u64, bytes: u64) {
        self.settle(now);
        self.active.push(Transfer {
            id,
            start_at: now + self.model.latency_ms,
            remaining: bytes as f64,
        });
        self.bytes_done += bytes;
    }

    fn sharing(&self, t: f64) -> usize {
        self.active.iter().filter(|x| x.start_at <= t).count()
    }

    /// Moves the fluid model forward to `t` without completing anything.
    fn settle(&mut self, t: f64) {
        while self.now < t {
            let n = self.sharing(self.now);
            // Next change of the sharing set: a latency phase ending.
            let next_start = self
                .active
                .iter()
                .filter(|x| x.start_at > self.now)
                .map(|x| x.start_at)
                .fold(f64::INFINITY, f64::min);
            let until = t.min(next_start);
            if n > 0 {
                let per = self.bytes_per_ms * (until - self.now) / n as f64;
                let now = self.now;
                for x in self.active.iter_mut().filter(|x| x.start_at <= now) {
                    x.remaining = (x.remaining - per).max(0.0);
                }
            }
            self.now = until;
        }
    }

    /// The time the next transfer completes, if any is in flight.
    pub fn next_completion(&self) -> Option<f64> {
        if self.active.is_empty() {
            return None;
        }
        // Simulate forward on a copy: cheap, the set in flight is small.
        let mut sim = self.clone();
        loop {
            let t = sim.now;
            let n = sim.sharing(t);
            let next_start = sim
                .active
                .iter()
                .filter(|x| x.start_at > t)
                .map(|x| x.start_at)
                .fold(f64::INFINITY, f64::min);
            if n == 0 {
                sim.now = next_start;
                continue;
            }
            let min_rem = sim
                .active
                .iter()
                .filter(|x| x.start_at <= t)
                .map(|x| x.remaining)
                .fold(f64::INFINITY, f64::min);
            let done_at = t + min_rem * n as f64 / sim.bytes_per_ms;
            if done_at <= next_start {
                return Some(done_at);
            }
            sim.settle(next_start);
        }
    }

    /// Advances to `t` and returns the ids of transfers complete by then.
    pub fn advance(&mut self, t: f64, done: &mut Vec<u64>) {
        while let Some(c) = self.next_completion() {
            if c > t {
                break;
            }
            self.settle(c);
            // Ties and float dust: anything within what the link moves in a few ulps of `c`
            // (at least a byte) is complete. Late in virtual time at a high bandwidth that dust
            // exceeds a byte, and a transfer left short by it would never finish: `c` could no
            // longer advance the clock.
            let dust = 1.0_f64.max(self.bytes_per_ms * c.abs() * 4.0 * f64::EPSILON);
            let before = done.len();
            let mut i = 0;
            while i < self.active.len() {
                let x = &self.active[i];
                if x.start_at <= c && x.remaining <= dust {
                    done.push(x.id);
                    self.active.swap_remove(i);
                } else {
                    i += 1;
                }
            }
            if done.len() == before {
                // Rounding still left it short: the transfer finishing at `c` is the started one
                // with the least remaining, so it completes now and the loop always progresses.
                if let Some(i) = self.least_remaining_started(c) {
                    done.push(self.active.swap_remove(i).id);
                }
            }
        }
        self.settle(t);
    }

    fn least_remaining_started(&self, t: f64) -> Option<usize> {
        self.active
            .iter()
            .enumerate()
            .filter(|(_, x)| x.start_at <= t)
            .min_by(|a, b| a.1.remaining.total_cmp(&b.1.remaining))
            .map(|(i, _)| i)
    }

    /// Drops a transfer (its request was aborted).
    pub fn cancel(&mut self, id: u64) {
        self.active.retain(|x| x.id != id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link() -> Link {
        // 1 GB/s = 1e6 bytes per ms, 1 ms latency.
        Link::new(LinkModel {
            gbps: 1.0,
            latency_ms: 1.0,
            full_prompt_transfer: false,
            push_ms: 0.0,
            pull: false,
        })
    }

    #[test]
    fn transfers_late_in_virtual_time_on_a_huge_link_still_complete() {
        // At t = 1e7 ms one ulp of the clock is ~2e-9 ms, during which 1e6 GB/s moves ~2 kB:
        // rounding leaves transfers short by more than a byte. They must finish, not spin.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut l = Link::new(LinkModel {
                gbps: 1e6,
                latency_ms: 0.0,
                full_prompt_transfer: false,
                push_ms: 0.0,
                pull: false,
            });
            let mut done = vec![];
            let mut t = 1e7;
            for id in 0..200u64 {
                l.start(t, id, 131_072 * (1 + id % 7) * 997);
                t += 0.37;
                l.advance(t, &mut done);
            }
            l.advance(t + 1.0, &mut done);
            let _ = tx.send((done.len(), l.in_flight()));
        });
        let got = rx.recv_timeout(std::time::Duration::from_secs(20));
        assert_eq!(got, Ok((200, 0)), "the link spun or lost transfers");
    }

    #[test]
    fn one_transfer_takes_latency_plus_size_over_bandwidth() {
        let mut l = link();
        l.start(0.0, 7, 10_000_000);
        let t = l.next_completion().unwrap();
        assert!((t - 11.0).abs() < 1e-9, "{t}");
        let mut done = vec![];
        l.advance(10.9, &mut done);
        assert!(done.is_empty());
        l.advance(11.0, &mut done);
        assert_eq!(done, vec![7]);
    }

    #[test]
    fn concurrent_transfers_share_the_bandwidth() {
        let mut l = link();
        l.start(0.0, 1, 10_000_000);
        l.start(0.0, 2, 10_000_000);
        // Both share: 20 MB at 1 MB/ms after 1 ms latency = 21 ms.
        let mut done = vec![];
        l.advance(20.5, &mut done);
        assert!(
            done.is_empty(),
            "shared transfers must not finish at the solo time"
        );
        l.advance(21.0 + 1e-9, &mut done);
        done.sort();
        assert_eq!(done, vec![1, 2]);
    }

    #[test]
    fn a_late_transfer_slows_the_one_in_flight() {
        let mut l = link();
        l.start(0.0, 1, 10_000_000);
        // At t=6 the first has 5 MB left; the second joins after its latency at t=7.
        l.start(6.0, 2, 10_000_000);
        let mut done = vec![];
        l.advance(100.0, &mut done);
        assert_eq!(done, vec![1, 2]);
        // Solo the first would end at 11; sharing from 7 it ends at 7 + 4·2 = 15.
        let mut l2 = link();
        l2.start(0.0, 1, 10_000_000);
        l2.start(6.0, 2, 10_000_000);
        let first = l2.next_completion().unwrap();
        assert!((first - 15.0).abs() < 1e-6, "{first}");
    }
}
