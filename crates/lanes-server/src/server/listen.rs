//! The server's own accept loop: TLS, the connection cap, the header timeout (which also
//! closes a keep-alive connection idle that long), the header size bound, and a graceful stop
//! with a deadline. `axum::serve` has none of these knobs.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

use lanes::BoxError;

/// How connections are taken and bounded.
#[derive(Clone)]
pub(crate) struct Transport {
    pub(crate) tls: Option<TlsAcceptor>,
    pub(crate) max_connections: usize,
    pub(crate) header_timeout: Duration,
    pub(crate) shutdown_timeout: Duration,
    /// The most bytes of a request head the guard allows (431 beyond; hyper buffers twice this).
    pub(crate) max_header_bytes: usize,
}

/// A TLS acceptor from PEM files: a certificate chain and its private key.
///
/// # Errors
///
/// A file cannot be read, holds no certificate or key, or they do not match (the message names
/// the file).
pub(crate) fn tls_acceptor(cert: &Path, key: &Path) -> Result<TlsAcceptor, BoxError> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .and_then(Iterator::collect)
        .map_err(|e| format!("TLS certificate {}: {e}", cert.display()))?;
    if certs.is_empty() {
        return Err(format!("TLS certificate {}: no certificate in it", cert.display()).into());
    }
    let key =
        PrivateKeyDer::from_pem_file(key).map_err(|e| format!("TLS key {}: {e}", key.display()))?;
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| format!("TLS certificate and key: {e}"))?;
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// Serves `router` on `listener` until `stop` turns true; then stops accepting, lets the open
/// connections finish their requests for up to the shutdown timeout, and drops the rest.
pub(crate) async fn serve(
    listener: TcpListener,
    router: Router,
    transport: Transport,
    mut stop: watch::Receiver<bool>,
) {
    let graceful = GracefulShutdown::new();
    let slots = Arc::new(Semaphore::new(transport.max_connections));
    let mut connections = JoinSet::new();
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(transport.header_timeout)
        // Room past the bound, so that a head over it reaches the guard, which answers the
        // 431 with a JSON body (one past twice the bound is refused by hyper, without one).
        .max_buf_size(transport.max_header_bytes.saturating_mul(2).max(8192));
    let stopped = async move {
        let _ = stop.wait_for(|stopping| *stopping).await;
    };
    tokio::pin!(stopped);
    loop {
        while connections.try_join_next().is_some() {}
        let (stream, _peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(err) => {
                    // Out of file descriptors and the like: wait a moment rather than spin.
                    tracing::warn!(%err, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut stopped => break,
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            connections.spawn(refuse(stream, transport.max_connections, transport.tls.is_some()));
            continue;
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(router.clone());
        let watcher = graceful.watcher();
        let (builder, tls) = (builder.clone(), transport.tls.clone());
        let header_timeout = transport.header_timeout;
        connections.spawn(async move {
            let _slot = slot;
            match tls {
                None => {
                    let connection = builder.serve_connection(TokioIo::new(stream), service);
                    let _ = watcher.watch(connection).await;
                }
                Some(acceptor) => {
                    // A handshake is part of the request head: bounded by the same timeout.
                    let handshake = tokio::time::timeout(header_timeout, acceptor.accept(stream));
                    if let Ok(Ok(stream)) = handshake.await {
                        let connection = builder.serve_connection(TokioIo::new(stream), service);
                        let _ = watcher.watch(connection).await;
                    }
                }
            }
        });
    }
    drop(listener);
    if tokio::time::timeout(transport.shutdown_timeout, graceful.shutdown()).await.is_err() {
        tracing::warn!(
            timeout_ms = transport.shutdown_timeout.as_millis() as u64,
            "connections still open at the shutdown deadline are dropped"
        );
    }
    connections.abort_all();
}

/// Answers a connection over the cap with a 503 and closes it (plain HTTP only: over TLS the
/// connection is just closed, a handshake being as costly as the work the cap saves).
async fn refuse(mut stream: TcpStream, max: usize, tls: bool) {
    if tls {
        return;
    }
    let body = serde_json::to_string(&lanes_remote::wire::ErrorBody {
        code: Some("too_many_connections".to_owned()),
        ..lanes_remote::wire::ErrorBody::new(format!(
            "this server takes at most {max} connections (--max-connections)"
        ))
    })
    .unwrap_or_default();
    let response = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        let _ = stream.write_all(response.as_bytes()).await;
        let _ = stream.shutdown().await;
    })
    .await;
}

impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transport")
            .field("tls", &self.tls.is_some())
            .field("max_connections", &self.max_connections)
            .field("header_timeout", &self.header_timeout)
            .field("shutdown_timeout", &self.shutdown_timeout)
            .finish()
    }
}
