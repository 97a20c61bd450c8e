//! The engine emulator's model: a vLLM-like engine (batching, paged prefix-cached KV,
//! preemption, step time, KV link), pure and driven by a clock the caller owns.

pub mod engine;
pub mod kv;
pub mod link;
pub mod profile;
pub mod text;

pub use engine::{Content, Engine, Event, Finish, Kind, Snapshot, Submit, SubmitError, Usage};
pub use profile::{ApiModel, BatchShape, Harness, LinkModel, Profile, StepModel};
