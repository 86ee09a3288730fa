//! When a reflector has delivered its first full list, for any number of waiters.
//!
//! `Store::wait_until_ready` is not enough when two tasks wait on the same store:
//! kube-runtime 5.0 keeps the readiness in a oneshot channel, which remembers only the
//! waker of the task that polled it last, so the other waiter may never wake. The hub's
//! planner and the FederatedMyApp controller both wait for that store; the planner hung
//! after about one hub restart in ten, and with it `/readyz`. A `watch` channel wakes
//! every waiter.

use std::future::Future;

use futures::{Stream, TryStreamExt};
use kube::runtime::watcher;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

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

    /// Drives `controller` (a kube-runtime `Controller` run with
    /// `graceful_shutdown_on(stop)` over the store this tracks) to its end.
    ///
    /// Graceful shutdown lets reconciles in flight finish; but kube-runtime 5.0 first
    /// holds its runner until the store is listed, and once `stop` fires it polls the
    /// watch no more, so a controller stopped before its store listed never ends (an
    /// agent that lost its Lease under an overloaded apiserver hung there for good,
    /// and ignored SIGTERM). Such a controller has started no reconcile: it is
    /// dropped at `stop` instead.
    pub async fn run_controller(
        &self,
        controller: impl Future<Output = ()>,
        stop: &CancellationToken,
    ) {
        tokio::select! {
            () = controller => {}
            () = async {
                stop.cancelled().await;
                if self.is_listed() {
                    std::future::pending::<()>().await
                }
            } => {}
        }
    }
}

/// Resolves once every one of `listed` has listed (at once for none); fails as soon as
/// one waited on ended before it listed.
pub async fn all(listed: &[Listed]) -> Result<(), NeverListed> {
    for listed in listed {
        listed.wait().await?;
    }
    Ok(())
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

    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use futures::StreamExt;
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::ObjectMeta;
    use kube::runtime::controller::Action;
    use kube::runtime::{Controller, WatchStreamExt, reflector};

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

    /// A controller over `events` whose every reconcile takes `reconcile_for` and is
    /// counted in `reconciled` when it finishes; run through
    /// [`Listed::run_controller`] until `stop`.
    fn controller(
        events: futures::channel::mpsc::UnboundedReceiver<
            Result<watcher::Event<ConfigMap>, watcher::Error>,
        >,
        reconcile_for: Duration,
        reconciled: Arc<AtomicUsize>,
        stop: CancellationToken,
    ) -> impl Future<Output = ()> {
        let (store, writer) = reflector::store::<ConfigMap>();
        let (events, listed) = track(reflector(writer, events));
        let run = Controller::for_stream(events.applied_objects(), store)
            .graceful_shutdown_on(stop.clone().cancelled_owned())
            .run(
                move |_, reconciled: Arc<Arc<AtomicUsize>>| async move {
                    tokio::time::sleep(reconcile_for).await;
                    reconciled.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, std::convert::Infallible>(Action::await_change())
                },
                |_, _, _| Action::await_change(),
                Arc::new(reconciled),
            )
            .for_each(|_| async {});
        async move { listed.run_controller(run, &stop).await }
    }

    /// The agent that lost its Lease before its MyApp store listed: the controller must
    /// end at `stop` (it hung for good before, the apiserver being unreachable).
    #[tokio::test]
    async fn a_controller_stopped_before_its_store_listed_ends() {
        let (feed, events) = futures::channel::mpsc::unbounded();
        let stop = CancellationToken::new();
        let reconciled = Arc::new(AtomicUsize::new(0));
        let run = tokio::spawn(controller(
            events,
            Duration::ZERO,
            reconciled.clone(),
            stop.clone(),
        ));
        feed.unbounded_send(Ok(watcher::Event::Init)).unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        stop.cancel();
        tokio::time::timeout(Duration::from_secs(5), run)
            .await
            .expect("the controller did not end at stop")
            .unwrap();
        assert_eq!(reconciled.load(Ordering::SeqCst), 0);
        drop(feed);
    }

    /// Once listed, stop stays graceful: a reconcile in flight finishes first.
    #[tokio::test]
    async fn a_listed_controller_finishes_its_reconciles_before_it_ends() {
        let (feed, events) = futures::channel::mpsc::unbounded();
        let stop = CancellationToken::new();
        let reconciled = Arc::new(AtomicUsize::new(0));
        let run = tokio::spawn(controller(
            events,
            Duration::from_millis(500),
            reconciled.clone(),
            stop.clone(),
        ));
        for event in [
            watcher::Event::Init,
            watcher::Event::InitApply(config_map("a")),
            watcher::Event::InitDone,
        ] {
            feed.unbounded_send(Ok(event)).unwrap();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        stop.cancel();
        tokio::time::timeout(Duration::from_secs(5), run)
            .await
            .expect("the controller did not end after its reconcile")
            .unwrap();
        assert_eq!(reconciled.load(Ordering::SeqCst), 1);
        drop(feed);
    }

    /// [`all`] waits for the last of several watches to list, and fails when one ends
    /// before it listed.
    #[tokio::test]
    async fn all_waits_for_every_watch() {
        all(&[]).await.unwrap();
        let (feeds, (streams, listed)): (Vec<_>, (Vec<_>, Vec<_>)) = (0..3)
            .map(|_| {
                let (_, writer) = reflector::store::<ConfigMap>();
                let (feed, events) = futures::channel::mpsc::unbounded();
                (feed, track(reflector(writer, events)))
            })
            .unzip();
        let drivers: Vec<_> = (streams.into_iter())
            .map(|events| tokio::spawn(events.for_each(|_| async {})))
            .collect();
        let waiter = tokio::spawn({
            let listed = listed.clone();
            async move { all(&listed).await }
        });
        // The first and the last listed, not the one between: not all yet.
        for feed in [&feeds[0], &feeds[2]] {
            for event in [watcher::Event::Init, watcher::Event::InitDone] {
                feed.unbounded_send(Ok(event)).unwrap();
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(listed[0].is_listed() && listed[2].is_listed());
        assert!(!waiter.is_finished(), "two of three listed is not all");
        for event in [watcher::Event::Init, watcher::Event::InitDone] {
            feeds[1].unbounded_send(Ok(event)).unwrap();
        }
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("all never resolved")
            .unwrap()
            .unwrap();
        drop(feeds);
        for driver in drivers {
            driver.await.unwrap();
        }

        let never = ended_before_listing().await;
        assert!(all(&[listed[0].clone(), never]).await.is_err());
    }

    /// A watch that began its initial list and ended before it finished.
    async fn ended_before_listing() -> Listed {
        let (_, writer) = reflector::store::<ConfigMap>();
        let (feed, events) = futures::channel::mpsc::unbounded();
        let (events, listed) = track(reflector(writer, events));
        feed.unbounded_send(Ok(watcher::Event::Init)).unwrap();
        drop(feed);
        events.for_each(|_| async {}).await;
        listed
    }

    #[tokio::test]
    async fn a_watch_that_ends_before_listing_says_so() {
        let listed = ended_before_listing().await;
        assert!(!listed.is_listed());
        assert!(listed.wait().await.is_err());
    }
}
