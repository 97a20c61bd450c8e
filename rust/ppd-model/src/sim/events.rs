//! The simulator's pending events in time order, ties in the order they were scheduled: arrivals (all known up front) and timeouts (each the same span after its send, so already in order) wait in queues, and only the rest goes through a heap, which stays small at 10,000 conversations a second.

use std::cmp::{Ordering, Reverse};
use std::collections::{BinaryHeap, VecDeque};

/// Orders f64 times (all times are finite and ≥ 0).
pub(super) fn time_key(t: f64) -> u64 {
    t.max(0.0).to_bits()
}

struct Entry<E> {
    key: u64,
    seq: u64,
    t: f64,
    e: E,
}

impl<E> Entry<E> {
    fn order(&self) -> (u64, u64) {
        (self.key, self.seq)
    }
}

impl<E> PartialEq for Entry<E> {
    fn eq(&self, other: &Self) -> bool {
        self.order() == other.order()
    }
}
impl<E> Eq for Entry<E> {}
impl<E> PartialOrd for Entry<E> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl<E> Ord for Entry<E> {
    fn cmp(&self, other: &Self) -> Ordering {
        self.order().cmp(&other.order())
    }
}

/// Where the earliest pending event waits.
#[derive(Clone, Copy)]
enum Source {
    Arrivals,
    Timeouts,
    Heap,
}

pub(super) struct Events<E> {
    seq: u64,
    arrivals: VecDeque<Entry<E>>,
    timeouts: VecDeque<Entry<E>>,
    heap: BinaryHeap<Reverse<Entry<E>>>,
}

impl<E> Events<E> {
    pub(super) fn new() -> Events<E> {
        Events {
            seq: 0,
            arrivals: VecDeque::new(),
            timeouts: VecDeque::new(),
            heap: BinaryHeap::new(),
        }
    }

    fn entry(&mut self, t: f64, e: E) -> Entry<E> {
        self.seq += 1;
        Entry {
            key: time_key(t),
            seq: self.seq,
            t,
            e,
        }
    }

    /// Any event at `t`.
    pub(super) fn push(&mut self, t: f64, e: E) {
        let entry = self.entry(t, e);
        self.heap.push(Reverse(entry));
    }

    /// An event no earlier than every arrival scheduled before it.
    pub(super) fn push_arrival(&mut self, t: f64, e: E) {
        let entry = self.entry(t, e);
        debug_assert!(self.arrivals.back().is_none_or(|b| b.key <= entry.key));
        self.arrivals.push_back(entry);
    }

    /// An event no earlier than every timeout scheduled before it (one
    /// timeout span after a send, and sends come in time order).
    pub(super) fn push_timeout(&mut self, t: f64, e: E) {
        let entry = self.entry(t, e);
        debug_assert!(self.timeouts.back().is_none_or(|b| b.key <= entry.key));
        self.timeouts.push_back(entry);
    }

    fn earliest(&self) -> Option<(Source, (u64, u64))> {
        [
            self.arrivals.front().map(|x| (Source::Arrivals, x.order())),
            self.timeouts.front().map(|x| (Source::Timeouts, x.order())),
            self.heap.peek().map(|Reverse(x)| (Source::Heap, x.order())),
        ]
        .into_iter()
        .flatten()
        .min_by_key(|&(_, order)| order)
    }

    /// The time of the earliest pending event (as ordered).
    pub(super) fn next_time(&self) -> Option<f64> {
        self.earliest().map(|(_, (key, _))| f64::from_bits(key))
    }

    /// The earliest pending event and its exact time.
    pub(super) fn pop(&mut self) -> Option<(f64, E)> {
        let entry = match self.earliest()?.0 {
            Source::Arrivals => self.arrivals.pop_front(),
            Source::Timeouts => self.timeouts.pop_front(),
            Source::Heap => self.heap.pop().map(|Reverse(x)| x),
        }?;
        Some((entry.t, entry.e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn events_leave_in_time_then_scheduling_order_whatever_queue_they_wait_in(
            arrivals in proptest::collection::vec(0u8..20, 0..30),
            others in proptest::collection::vec((0u8..3, 0u8..20), 0..60),
        ) {
            let mut ev = Events::new();
            let mut all = Vec::new();
            let mut a = arrivals.clone();
            a.sort_unstable();
            for t in a {
                ev.push_arrival(f64::from(t), ev.seq + 1);
                all.push((t, ev.seq));
            }
            let mut last_timeout = 0u8;
            for (kind, t) in others {
                let id = ev.seq + 1;
                if kind == 0 && t >= last_timeout {
                    last_timeout = t;
                    ev.push_timeout(f64::from(t), id);
                } else {
                    ev.push(f64::from(t), id);
                }
                all.push((t, id));
            }
            all.sort_unstable();
            let mut out = Vec::new();
            while let Some((t, id)) = ev.pop() {
                out.push((t as u8, id));
            }
            prop_assert_eq!(out, all);
        }
    }
}
