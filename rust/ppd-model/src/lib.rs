//! ppd-model: a model of a vLLM engine — continuous batching, paged prefix-cached KV,
//! preemption, step time, the KV link — and the virtual-time cluster simulator built on it.
//!
//! Pure and driven by a clock the caller owns: the emulator (`ppd-emulator`)
//! runs [`engine::Engine`] against the wall clock behind vLLM's HTTP API; the
//! simulator ([`sim`]) runs many engines in virtual time with ppd-core's
//! decision engine as the router. The router itself never links this crate.

pub mod engine;
pub mod kv;
pub mod link;
pub mod sim;
pub mod text;

// The profile is ppd-core's (the router's cost model predicts with the same numbers).
pub use engine::{Content, Engine, Event, Finish, Kind, Snapshot, Submit, SubmitError, Usage};
pub use ppd_core::profile;
pub use ppd_core::profiles::{
    load_profile, DEFAULT_PROFILE, DEFAULT_PROFILE_NAME, NIXL_PROFILE_NAME,
};
pub use profile::{ApiModel, BatchShape, Harness, LinkModel, Profile, StepModel};
