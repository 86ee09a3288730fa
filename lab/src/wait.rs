//! Waiting with a deadline: [`await_object`] watches one object until it meets a
//! condition (a CRD Established, a node or a MemberCluster Ready); [`wait_for`] polls
//! anything else (lists, HTTP, metrics, several objects at once).

use anyhow::{Result, anyhow};
use kube::runtime::wait::{Condition, await_condition};
use kube::{Api, Resource};
use serde::de::DeserializeOwned;
use std::fmt::Debug;
use std::future::Future;
use std::time::{Duration, Instant};

/// How often [`wait_for`] polls.
pub const POLL: Duration = Duration::from_millis(200);

/// Polls `check` until it returns `Ok(Some(value))` or `timeout` passes.
///
/// `Ok(None)` means "not yet"; an `Err` is treated as "not yet" too (apiservers starting
/// up answer with errors for a while), and the last one is reported if time runs out.
pub async fn wait_for<T, F, Fut>(timeout: Duration, what: &str, check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>>>,
{
    wait_for_every(POLL, timeout, what, check).await
}

/// [`wait_for`], polling every `poll`: for checks too heavy to make five times a second
/// (lists of thousands of objects).
pub async fn wait_for_every<T, F, Fut>(
    poll: Duration,
    timeout: Duration,
    what: &str,
    mut check: F,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>>>,
{
    let deadline = Instant::now() + timeout;
    let mut last_err = None;
    loop {
        match check().await {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last_err = Some(e),
        }
        if Instant::now() >= deadline {
            return Err(timed_out(timeout, what, last_err));
        }
        tokio::time::sleep(poll).await;
    }
}

/// Watches object `name` of `api` until `cond` holds for it (`cond` sees `None` while the
/// object does not exist), or `timeout` passes; returns the object as it was then (`None`
/// if `cond` held for its absence). As in [`wait_for`], an error is "not yet": the watch
/// starts again after [`POLL`], and the last error is reported if time runs out.
pub async fn await_object<K>(
    api: &Api<K>,
    name: &str,
    timeout: Duration,
    what: &str,
    cond: impl Condition<K>,
) -> Result<Option<K>>
where
    K: Clone + Debug + Send + DeserializeOwned + Resource + 'static,
{
    let deadline = Instant::now() + timeout;
    let mut last_err = None;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let watch = await_condition(api.clone(), name, |o: Option<&K>| cond.matches_object(o));
        match tokio::time::timeout(left, watch).await {
            Ok(Ok(object)) => return Ok(object),
            Ok(Err(e)) => last_err = Some(anyhow::Error::new(e)),
            Err(_) => return Err(timed_out(timeout, what, last_err)),
        }
        if Instant::now() >= deadline {
            return Err(timed_out(timeout, what, last_err));
        }
        tokio::time::sleep(POLL).await;
    }
}

fn timed_out(timeout: Duration, what: &str, last_err: Option<anyhow::Error>) -> anyhow::Error {
    match last_err {
        Some(e) => anyhow!("timed out after {timeout:?} waiting for {what}; last error: {e:#}"),
        None => anyhow!("timed out after {timeout:?} waiting for {what}"),
    }
}

/// Waits for an Event with `reason` about the object named `object` in `namespace`
/// (where the hub records Events about cluster-scoped MemberClusters too: `default`).
pub async fn wait_event(
    client: &kube::Client,
    namespace: &str,
    object: &str,
    reason: &str,
    timeout: Duration,
) -> Result<k8s_openapi::api::core::v1::Event> {
    let events: kube::Api<k8s_openapi::api::core::v1::Event> =
        kube::Api::namespaced(client.clone(), namespace);
    let selector = format!("involvedObject.name={object}");
    wait_for(
        timeout,
        &format!("a {reason} Event on {object}"),
        || async {
            let list = events
                .list(&kube::api::ListParams::default().fields(&selector))
                .await?;
            Ok(list
                .items
                .into_iter()
                .find(|e| e.reason.as_deref() == Some(reason)))
        },
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn returns_the_first_value() {
        let mut n = 0;
        let v = wait_for(Duration::from_secs(5), "n to reach 3", || {
            n += 1;
            let n = n;
            async move { Ok((n >= 3).then_some(n)) }
        })
        .await
        .unwrap();
        assert_eq!(v, 3);
    }

    #[tokio::test]
    async fn times_out_with_the_last_error() {
        let err = wait_for::<(), _, _>(Duration::from_millis(300), "nothing", || async {
            Err(anyhow!("still broken"))
        })
        .await
        .unwrap_err();
        let msg = format!("{err:#}");
        assert!(
            msg.contains("waiting for nothing") && msg.contains("still broken"),
            "{msg}"
        );
    }
}
