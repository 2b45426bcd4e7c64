//! Where handler progress and the last handled state live: on the objects themselves.
//!
//! There is no database. Progress records (one per handler), the diff-base (the essence last
//! handled) and the finalizer are annotations, status fields or metadata on each object, with
//! kopf's key formats so that an operator migrated from kopf keeps its state. Storages never
//! talk to the API: they read a body and write into a local copy of it, and the engine folds
//! every change of a processing cycle into one PATCH.

pub mod diffbase;
pub mod keys;
pub mod node;
pub mod node_store;
pub mod progress;
pub mod retry;
pub mod survey;
pub mod time;

pub use diffbase::DiffBaseStorage;
pub use keys::Keys;
pub use progress::{ProgressRecord, ProgressStorage};
