//! Flotilla's planning core: from one FederatedMyApp and the registered clusters, what
//! every cluster must run, and from agents' reports, what the app's status says. Pure:
//! no I/O, no async runtime, no Kubernetes client; equal inputs give equal outputs. The
//! hub (`flotilla-hub`) carries the effects: watches, the gRPC service, the writers.
//!
//! Modules follow the data flow:
//! - [`admission`]: what an app must be to be planned at all: a namespace that is not
//!   forbidden, a template and overrides within size limits;
//! - [`placement`]: which registered clusters an app goes to, and what planning reads of
//!   a MemberCluster ([`placement::Member`]);
//! - [`grants`]: which of them the app's namespace may place on (its ClusterGrants);
//! - [`schedule`]: how many replicas each placed cluster runs, as named steps
//!   (validate, classify, spread, apportion, assign, transition);
//! - [`overrides`]: one cluster's RFC 6902 operations on the template;
//! - [`render`]: one cluster's MyApp (template + replicas + overrides + schema check +
//!   content hash);
//! - [`mod@plan`]: the entry point, [`plan()`]: placement → schedule → render per cluster,
//!   into one [`AppPlan`] whose per-cluster [`ClusterPlan`] says apply, keep or nothing;
//! - [`rollout`]: which placed clusters a new revision may reach now (waves, soak,
//!   deadline), from what the agents report;
//! - [`index`]: the desired set per cluster and what agents hold, the state machine the
//!   safety rules live in;
//! - [`planner`]: which apps each trigger (an app applied or gone, the clusters changed,
//!   a recheck) plans again, and what each plan writes: the hub's one writer of the
//!   index runs it;
//! - [`status`]: the fold of a plan and agents' reports into `FederatedMyApp.status`.
#![warn(clippy::too_many_lines)]

pub mod admission;
pub mod grants;
pub mod index;
pub mod overrides;
pub mod placement;
pub mod plan;
pub mod planner;
pub mod render;
pub mod rollout;
pub mod schedule;
pub mod status;

pub use flotilla_crds::AppKey;
pub use plan::{AppPlan, ClusterPlan, KeepReason, plan};
