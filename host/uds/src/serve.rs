//! [`serve`]: the gRPC server side of Pluglet's sockets, on hyper's HTTP/2 connection directly.
//!
//! Why not `tonic::transport::Server`: it wraps every request in layers Pluglet's servers do not
//! use (a router, a `grpc-timeout` timer, error recovery, connection info, a concurrency and
//! load-shed slot), each one more boxed future and more polls per call. A tonic-generated server
//! (`FooServer::new(service)`) already routes its own methods and answers unknown ones with
//! `UNIMPLEMENTED`, so it is handed to hyper as it is. On the admin socket this took about an
//! eighth of an admin round trip's instructions (docs/performance.md, "Connections").
//!
//! What stays as tonic's server did it: HTTP/2 only, hyper's default settings (but no `date`
//! header on answers), a connection's errors logged at debug level, and on shutdown no new
//! connections while open ones finish their calls (each gets a graceful `GOAWAY`) before
//! `serve` returns. A `grpc-timeout` is not
//! enforced here: a client that gives up resets its stream, and hyper then drops the call.
//!
//! What differs: an accept error (too many open files, say) is logged as a warning and the next
//! accept waits a little, from [`ACCEPT_PAUSE_FIRST`] doubling up to [`ACCEPT_PAUSE_MAX`]
//! while the errors go on. tonic's server retried at once, so a daemon out of file descriptors
//! spun a core on a listener that stayed readable.

use std::convert::Infallible;
use std::future::Future;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::watch;
use tokio_stream::{Stream, StreamExt};

/// The pause after a first failed accept.
pub const ACCEPT_PAUSE_FIRST: Duration = Duration::from_millis(5);
/// The longest pause between failed accepts.
pub const ACCEPT_PAUSE_MAX: Duration = Duration::from_secs(1);

/// What [`serve`] serves: a tonic-generated server (`FooServer::new(service)`), or
/// [`Routes`](crate::Routes) in front of one.
pub trait GrpcServer:
    tower::Service<
        http::Request<hyper::body::Incoming>,
        Response = http::Response<tonic::body::Body>,
        Error = Infallible,
        Future: Send + 'static,
    > + Clone
    + Send
    + 'static
{
}

impl<S> GrpcServer for S where
    S: tower::Service<
            http::Request<hyper::body::Incoming>,
            Response = http::Response<tonic::body::Body>,
            Error = Infallible,
            Future: Send + 'static,
        > + Clone
        + Send
        + 'static
{
}

/// Serves `service` (a [`GrpcServer`]) on every connection `incoming` yields, until
/// `shutdown` resolves; then stops accepting, asks every open connection to close once its
/// calls are answered, and returns when all have closed.
///
/// An accept error (too many open files, say) is logged, and accepting goes on after a pause
/// (see the module doc).
pub async fn serve<I, IO, E, S, F>(incoming: I, service: S, shutdown: F)
where
    I: Stream<Item = Result<IO, E>>,
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    E: std::fmt::Display,
    S: GrpcServer,
    F: Future<Output = ()>,
{
    let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    // No `date` header: gRPC does not use it, and it is a header to format and encode on
    // every answer.
    builder.timer(TokioTimer::new()).auto_date_header(false);
    let service = TowerToHyperService::new(service);
    // Every connection holds a receiver; the sender says "shut down" and then waits for the
    // receivers to be dropped, which each connection does once it has closed.
    let (stop, stopped) = watch::channel(());
    {
        let mut incoming = std::pin::pin!(incoming);
        let mut shutdown = std::pin::pin!(shutdown);
        let mut pause: Option<Duration> = None;
        loop {
            let io = tokio::select! {
                () = &mut shutdown => break,
                io = incoming.next() => match io {
                    Some(Ok(io)) => {
                        pause = None;
                        io
                    }
                    Some(Err(error)) => {
                        let wait = pause.map_or(ACCEPT_PAUSE_FIRST, |p| (p * 2).min(ACCEPT_PAUSE_MAX));
                        pause = Some(wait);
                        tracing::warn!(%error, retry_in = ?wait, "cannot accept a connection");
                        tokio::select! {
                            () = &mut shutdown => break,
                            () = tokio::time::sleep(wait) => continue,
                        }
                    }
                    None => break,
                },
            };
            // Boxed: the connection's state is kilobytes, and a task's future is copied
            // whole into the task as it is spawned and again when it finishes.
            let mut connection =
                Box::pin(builder.serve_connection(TokioIo::new(io), service.clone()));
            let mut stopped = stopped.clone();
            tokio::spawn(async move {
                let result = tokio::select! {
                    result = &mut connection => result,
                    _ = stopped.changed() => {
                        connection.as_mut().graceful_shutdown();
                        connection.await
                    }
                };
                if let Err(error) = result {
                    tracing::debug!(%error, "gRPC connection ended");
                }
                drop(stopped);
            });
        }
    }
    drop(stopped);
    let _ = stop.send(());
    stop.closed().await;
}
