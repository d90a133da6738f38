//! A reload (SIGHUP, `systemctl reload kmqd`; docs/OPERATIONS.md, "Reloading"), in two parts: `plan.rs`, the pure
//! comparison of the running config with the new one (what changes live, what needs a restart), and `apply.rs`,
//! the supervisor applying that plan to the running daemon. Apart so that the decision is read and tested by
//! tables, without the threads and the Redis checks its application needs.

mod apply;
pub mod plan;

pub use plan::{Plan, plan};
