//! The end of a long-running command: SIGTERM or Ctrl-C.

use std::io::Write as _;

/// Resolves on Ctrl-C (SIGINT) or SIGTERM, and says so on stderr as `<who>: shutting down`.
/// The handlers are in place when this returns, before the future is first polled: a signal
/// sent as soon as the process says it runs is not lost (it would kill the process).
pub fn shutdown_signal(who: &'static str) -> impl std::future::Future<Output = ()> {
    #[cfg(unix)]
    let signals = {
        use tokio::signal::unix::{signal, SignalKind};
        [
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        ]
    };
    async move {
        #[cfg(unix)]
        {
            // A handler that could not be installed never resolves: the other one stops us.
            let [interrupt, terminate] = signals.map(|signal| async move {
                match signal {
                    Ok(mut signal) => {
                        signal.recv().await;
                    }
                    Err(_) => std::future::pending::<()>().await,
                }
            });
            tokio::select! {
                () = interrupt => {},
                () = terminate => {},
            }
        }
        #[cfg(not(unix))]
        {
            if tokio::signal::ctrl_c().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
        let _ = writeln!(std::io::stderr(), "{who}: shutting down");
    }
}
