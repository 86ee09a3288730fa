//! When a reflector has delivered its first full list, for any number of waiters.
//!
//! `Store::wait_until_ready` is not enough when two tasks wait on the same store:
//! kube-runtime 5.0 keeps the readiness in a oneshot channel, which remembers only the
//! waker of the task that polled it last, so the other waiter may never wake. The hub's
//! planner and the FederatedMyApp controller both wait for that store; the planner hung
//! after about one hub restart in ten, and with it `/readyz`. A `watch` channel wakes
//! every waiter.

use futures::{Stream, TryStreamExt};
use kube::runtime::watcher;
use tokio::sync::watch;

/// Resolves once the stream passed to [`track`] has delivered `InitDone`.
#[derive(Clone, Debug)]
pub struct Listed(watch::Receiver<bool>);

/// The stream ended (the process is stopping) before it listed.
#[derive(Debug, thiserror::Error)]
#[error("the watch ended before it listed")]
pub struct NeverListed;

impl Listed {
    pub async fn wait(&self) -> Result<(), NeverListed> {
        let mut listed = self.0.clone();
        listed
            .wait_for(|l| *l)
            .await
            .map(drop)
            .map_err(|_| NeverListed)
    }

    pub fn is_listed(&self) -> bool {
        *self.0.borrow()
    }
}

/// Passes `events` through, marking [`Listed`] at the first `InitDone`. Put it after the
/// reflector, so that the store holds the whole list when waiters wake.
pub fn track<K, S>(events: S) -> (impl Stream<Item = S::Item>, Listed)
where
    S: Stream<Item = Result<watcher::Event<K>, watcher::Error>>,
{
    let (tx, rx) = watch::channel(false);
    let events = events.inspect_ok(move |event| {
        if matches!(event, watcher::Event::InitDone) {
            tx.send_replace(true);
        }
    });
    (events, Listed(rx))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use futures::StreamExt;
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::ObjectMeta;
    use kube::runtime::reflector;

    use super::*;

    fn config_map(name: &str) -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    /// The hub's case: the controller waits on the store in one task, the planner waits
    /// here in another, and the controller polled last. The planner must still wake,
    /// and see the whole list.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_waiter_wakes_even_when_another_task_waits_on_the_store() {
        let (store, writer) = reflector::store::<ConfigMap>();
        let (feed, events) = futures::channel::mpsc::unbounded();
        let (events, listed) = track(reflector(writer, events));

        let planner = tokio::spawn({
            let (listed, store) = (listed.clone(), store.clone());
            async move {
                listed.wait().await.unwrap();
                store.state().len()
            }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        let controller = tokio::spawn({
            let store = store.clone();
            async move { store.wait_until_ready().await.is_ok() }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;

        let driver = tokio::spawn(events.for_each(|_| async {}));
        for event in [
            watcher::Event::Init,
            watcher::Event::InitApply(config_map("a")),
            watcher::Event::InitApply(config_map("b")),
            watcher::Event::InitDone,
        ] {
            feed.unbounded_send(Ok(event)).unwrap();
        }
        let seen = tokio::time::timeout(Duration::from_secs(5), planner)
            .await
            .expect("the planner never woke")
            .unwrap();
        assert_eq!(seen, 2);
        assert!(listed.is_listed());
        drop(feed);
        driver.await.unwrap();
        drop(controller);
    }

    #[tokio::test]
    async fn a_watch_that_ends_before_listing_says_so() {
        let (_, writer) = reflector::store::<ConfigMap>();
        let (feed, events) = futures::channel::mpsc::unbounded();
        let (events, listed) = track(reflector(writer, events));
        feed.unbounded_send(Ok(watcher::Event::Init)).unwrap();
        drop(feed);
        events.for_each(|_| async {}).await;
        assert!(!listed.is_listed());
        assert!(listed.wait().await.is_err());
    }
}
