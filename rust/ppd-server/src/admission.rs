//! Admission: how fast requests may arrive, how many requests and prompt tokens each node may have in flight, how long a request may wait for room, and what is shed.
//!
//! Between the route step and orchestration: a routed request takes a slot
//! (and its prompt tokens) on the node that will decode it, waiting in a
//! bounded queue for at most `queue_timeout`. Beyond the rate limit it gets
//! 429, with the queue full or its wait over 503, both with `Retry-After`,
//! so an overloaded cluster answers fast instead of timing clients out.

use axum::http::{HeaderValue, StatusCode};
use axum::response::Response;
use governor::clock::{Clock, DefaultClock};
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::RouterConfig;
use crate::error::openai_error;

/// A node's room: in-flight requests and in-flight prompt tokens (`None`: unlimited).
#[derive(Debug, Default)]
pub struct NodeSlots {
    requests: Option<Arc<Semaphore>>,
    tokens: Option<(Arc<Semaphore>, u32)>,
}

impl NodeSlots {
    pub fn new(max_requests: u32, max_tokens: u32) -> NodeSlots {
        NodeSlots {
            requests: (max_requests > 0).then(|| Arc::new(Semaphore::new(max_requests as usize))),
            tokens: (max_tokens > 0)
                .then(|| (Arc::new(Semaphore::new(max_tokens as usize)), max_tokens)),
        }
    }

    fn unlimited(&self) -> bool {
        self.requests.is_none() && self.tokens.is_none()
    }

    /// Room for one request of `tokens` prompt tokens, if there is some now.
    fn try_take(&self, tokens: u32) -> Option<Admitted> {
        let request = match &self.requests {
            Some(s) => Some(Arc::clone(s).try_acquire_owned().ok()?),
            None => None,
        };
        let tokens = match &self.tokens {
            // A prompt larger than the whole budget takes all of it, alone.
            Some((s, max)) => Some(
                Arc::clone(s)
                    .try_acquire_many_owned(tokens.min(*max))
                    .ok()?,
            ),
            None => None,
        };
        Some(Admitted {
            _slots: (request, tokens),
        })
    }

    /// Room for one request, waiting in line (the semaphores are fair).
    async fn take(&self, tokens: u32) -> Option<Admitted> {
        let request = match &self.requests {
            Some(s) => Some(Arc::clone(s).acquire_owned().await.ok()?),
            None => None,
        };
        let tokens = match &self.tokens {
            Some((s, max)) => Some(
                Arc::clone(s)
                    .acquire_many_owned(tokens.min(*max))
                    .await
                    .ok()?,
            ),
            None => None,
        };
        Some(Admitted {
            _slots: (request, tokens),
        })
    }
}

/// A request's room on its node, given back when the request ends.
#[derive(Debug)]
pub(crate) struct Admitted {
    _slots: (Option<OwnedSemaphorePermit>, Option<OwnedSemaphorePermit>),
}

impl Admitted {
    /// For a node without limits.
    fn free() -> Admitted {
        Admitted {
            _slots: (None, None),
        }
    }
}

/// Why a request was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shed {
    /// Over the arrival rate limit; may retry after this long.
    Rate(Duration),
    /// The wait queue is full.
    QueueFull,
    /// It waited `queue_timeout` for room on its node.
    QueueTimeout,
}

impl Shed {
    pub fn as_str(self) -> &'static str {
        match self {
            Shed::Rate(_) => "shed_rate",
            Shed::QueueFull => "shed_queue_full",
            Shed::QueueTimeout => "shed_queue_timeout",
        }
    }

    /// 429 for the rate limit, 503 for capacity; `Retry-After` either way.
    pub fn response(self) -> Response {
        let (status, message, code, after) = match self {
            Shed::Rate(wait) => (
                StatusCode::TOO_MANY_REQUESTS,
                "too many requests: over the router's rate limit",
                "rate_limit_exceeded",
                wait.as_secs().max(1),
            ),
            Shed::QueueFull => (
                StatusCode::SERVICE_UNAVAILABLE,
                "the router is at capacity: its wait queue is full",
                "queue_full",
                1,
            ),
            Shed::QueueTimeout => (
                StatusCode::SERVICE_UNAVAILABLE,
                "the router is at capacity: no node had room within the queue timeout",
                "queue_timeout",
                1,
            ),
        };
        let kind = if status == StatusCode::TOO_MANY_REQUESTS {
            "rate_limit_error"
        } else {
            "service_unavailable"
        };
        let mut r = openai_error(status, message, kind, code);
        r.headers_mut()
            .insert("retry-after", HeaderValue::from(after));
        r
    }
}

/// The router's admission state: the rate limiter and the wait queue.
pub(crate) struct Admission {
    limiter: Option<DefaultDirectRateLimiter>,
    waiting: AtomicUsize,
    queue_size: usize,
    queue_timeout: Duration,
}

impl Admission {
    pub fn new(cfg: &RouterConfig) -> Admission {
        let limiter = NonZeroU32::new(cfg.rate_limit).map(|rate| {
            let burst = NonZeroU32::new(cfg.rate_limit_burst).unwrap_or(rate);
            RateLimiter::direct(Quota::per_second(rate).allow_burst(burst))
        });
        Admission {
            limiter,
            waiting: AtomicUsize::new(0),
            queue_size: cfg.queue_size,
            queue_timeout: Duration::from_secs_f64(cfg.queue_timeout),
        }
    }

    /// The arrival rate limit, checked before any work is done for a request.
    pub fn arrival(&self) -> Result<(), Shed> {
        match &self.limiter {
            Some(l) => l.check().map_err(|not_until| {
                Shed::Rate(not_until.wait_time_from(DefaultClock::default().now()))
            }),
            None => Ok(()),
        }
    }

    /// Requests waiting for room now.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    /// Room on `slots` for a request of `tokens` prompt tokens: at once, or
    /// after waiting in the bounded queue. The second value says it waited.
    pub async fn admit(&self, slots: &NodeSlots, tokens: u32) -> Result<(Admitted, bool), Shed> {
        if slots.unlimited() {
            return Ok((Admitted::free(), false));
        }
        if let Some(a) = slots.try_take(tokens) {
            return Ok((a, false));
        }
        if self.waiting.fetch_add(1, Ordering::AcqRel) >= self.queue_size {
            self.waiting.fetch_sub(1, Ordering::AcqRel);
            return Err(Shed::QueueFull);
        }
        let waited = tokio::time::timeout(self.queue_timeout, slots.take(tokens)).await;
        self.waiting.fetch_sub(1, Ordering::AcqRel);
        match waited {
            Ok(Some(a)) => Ok((a, true)),
            Ok(None) | Err(_) => Err(Shed::QueueTimeout),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admission(queue_size: usize, queue_timeout: f64, rate: u32) -> Admission {
        Admission::new(&RouterConfig {
            queue_size,
            queue_timeout,
            rate_limit: rate,
            ..RouterConfig::default()
        })
    }

    #[tokio::test]
    async fn a_full_node_queues_then_admits_when_room_frees() {
        let a = Arc::new(admission(4, 5.0, 0));
        let slots = Arc::new(NodeSlots::new(1, 0));
        let (first, waited) = a.admit(&slots, 10).await.unwrap();
        assert!(!waited);
        let (a2, s2) = (Arc::clone(&a), Arc::clone(&slots));
        let second = tokio::spawn(async move { a2.admit(&s2, 10).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(a.waiting(), 1);
        drop(first);
        let (_, waited) = second.await.unwrap().unwrap();
        assert!(waited);
        assert_eq!(a.waiting(), 0);
    }

    #[tokio::test]
    async fn the_queue_is_bounded_and_so_is_the_wait() {
        let a = Arc::new(admission(1, 0.2, 0));
        let slots = Arc::new(NodeSlots::new(1, 0));
        let _held = a.admit(&slots, 1).await.unwrap();
        let (a2, s2) = (Arc::clone(&a), Arc::clone(&slots));
        let waiter = tokio::spawn(async move { a2.admit(&s2, 1).await.map(|_| ()) });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(a.admit(&slots, 1).await.unwrap_err(), Shed::QueueFull);
        assert_eq!(waiter.await.unwrap().unwrap_err(), Shed::QueueTimeout);
        assert_eq!(a.waiting(), 0);
    }

    #[tokio::test]
    async fn prompt_tokens_are_a_budget_and_a_huge_prompt_runs_alone() {
        let a = admission(0, 0.1, 0);
        let slots = NodeSlots::new(0, 1000);
        let (big, _) = a.admit(&slots, 50_000).await.unwrap();
        // Nothing else fits beside it; with no queue, shed at once.
        assert_eq!(a.admit(&slots, 1).await.unwrap_err(), Shed::QueueFull);
        drop(big);
        let (_six, _) = a.admit(&slots, 600).await.unwrap();
        let (_four, _) = a.admit(&slots, 400).await.unwrap();
        assert!(a.admit(&slots, 1).await.is_err());
    }

    #[test]
    fn the_rate_limit_answers_429_with_a_retry_time() {
        let a = admission(0, 1.0, 2);
        assert!(a.arrival().is_ok() && a.arrival().is_ok());
        let shed = a.arrival().unwrap_err();
        assert!(matches!(shed, Shed::Rate(_)));
        let r = shed.response();
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert!(
            r.headers()["retry-after"]
                .to_str()
                .unwrap()
                .parse::<u64>()
                .unwrap()
                >= 1
        );
        assert!(admission(0, 1.0, 0).arrival().is_ok());
    }

    #[test]
    fn capacity_sheds_are_503_with_retry_after() {
        for s in [Shed::QueueFull, Shed::QueueTimeout] {
            let r = s.response();
            assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
            assert_eq!(r.headers()["retry-after"], "1");
        }
    }
}
