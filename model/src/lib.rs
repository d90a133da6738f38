//! A model of kmqd's Redis-side protocol, checked exhaustively with [stateright](https://docs.rs/stateright):
//! "a task is never lost or applied twice" as a checked claim over every interleaving of the scripts, the
//! daemons' steps that call them, crashes, stalls and lost replies, within small bounds.
//!
//! - [`redis`]: what Redis holds for one queue, and each script of `src/broker/scripts/` as a function on it;
//! - [`model`]: each daemon's memory, the actions (one per script call or daemon step), and the properties;
//! - [`canon`]: canonical forms (renumbering, the daemons' symmetry), so that equivalent states count once;
//! - [`setup`]: the bounds, the scenarios the CI check runs, and the mutations that break the protocol on
//!   purpose;
//! - [`run`]: running a check, and the search for the shortest counterexample;
//! - [`turns`]: `priority_weights`' turns (turns.lua), a model of their own: the credits of the levels;
//! - [`types`]: limits per task type (types.lua, claim.lua's flow path, settle.lua's runs), a model of their own;
//! - [`groups`]: fair groups (groups.lua, claim.lua's grouped path, settle.lua's unparking, group_resume.lua), a
//!   model of their own;
//! - [`wake`]: the wake-up of a claim that filled `max_running` (claim.lua's state 8, the fetcher's wait behind a
//!   `BLPOP`, settle.lua's and push.lua's markers), a model of its own.
//! - [`group_types`]: groups beside type limits (groups.lua's flows of a group's limited type and park indexes,
//!   settle.lua's and group_resume.lua's emptying of them), a model of their own.
//!
//! - [`flows`]: issue 36's flows (after.lua's notes in the settle's step, the outbox's movers, flow_apply.lua's
//!   record keyed by dependency): a waiting task released exactly once, after all its dependencies, a model of
//!   its own.
//!
//! - [`unique`]: unique for a time (issue 37: unique_hold.lua's holds, settle.lua's and dead_requeue.lua's taking
//!   an id again with its window, remove.lua's cancel), a model of its own.
//!
//! See `model/README.md` for what the model covers, what it leaves out, and what the checker found.

pub mod canon;
pub mod flows;
pub mod group_types;
pub mod groups;
pub mod model;
pub mod redis;
pub mod run;
pub mod setup;
pub mod turns;
pub mod types;
pub mod unique;
pub mod wake;

pub use model::{Action, Protocol, State};
