//! `RemoteLimits` talks HTTPS: to a local TLS endpoint with a self-signed certificate, which it
//! trusts only when told to.

use std::sync::Arc;
use std::time::Duration;

use lanes::{LimitBackend, LimitError, LimitSpec};
use lanes_remote::{RemoteLimits, reqwest, wire};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio_rustls::rustls::{ServerConfig, crypto};

/// A TLS endpoint on 127.0.0.1 that answers the two reads of the API a test makes, one request
/// per connection; returns its `https://` address and its certificate.
async fn tls_endpoint() -> (String, CertificateDer<'static>) {
    let cert = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_owned()]).unwrap();
    let der = cert.cert.der().clone();
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(cert.signing_key.serialize_der()));
    let config =
        ServerConfig::builder_with_provider(Arc::new(crypto::aws_lc_rs::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![der.clone()], key)
            .unwrap();
    let acceptor = TlsAcceptor::from(Arc::new(config));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("https://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else { return };
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                // A client that does not trust the certificate ends the handshake.
                let Ok(mut tls) = acceptor.accept(tcp).await else { return };
                let mut request = Vec::new();
                let mut buf = [0; 4096];
                while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                    match tls.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => request.extend_from_slice(&buf[..n]),
                    }
                }
                let head = String::from_utf8_lossy(&request);
                let limit = wire::Limit {
                    name: "db".to_owned(),
                    concurrent: 4,
                    per_second: None,
                    burst: 1,
                    in_use: 1,
                    waiting: 2,
                    max_in_use: 3,
                    granted_total: 9,
                    mode: None,
                    shares: Vec::new(),
                };
                let (status, body) = if head.starts_with("GET /v1/limits/db ") {
                    ("200 OK", serde_json::to_string(&limit).unwrap())
                } else if head.starts_with("GET /v1/limits ") {
                    let list = wire::LimitList { limits: vec![limit] };
                    ("200 OK", serde_json::to_string(&list).unwrap())
                } else {
                    ("404 Not Found", serde_json::to_string(&wire::ErrorBody::new("no")).unwrap())
                };
                let response = format!(
                    "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = tls.write_all(response.as_bytes()).await;
                let _ = tls.shutdown().await;
            });
        }
    });
    (base, der)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_limits_talk_https_to_a_server_they_trust() {
    let (base, cert) = tls_endpoint().await;
    let http = reqwest::Client::builder()
        .tls_certs_only([reqwest::Certificate::from_der(&cert).unwrap()])
        .build()
        .unwrap();
    let remote =
        RemoteLimits::with_http_client(base, "https-test", Duration::from_secs(10), http).unwrap();
    let info = remote.info("db").await.unwrap().expect("the limit");
    assert_eq!(info.name, "db");
    assert_eq!(info.spec, LimitSpec::concurrent(4));
    assert_eq!((info.in_use, info.waiting, info.max_in_use, info.granted_total), (1, 2, 3, 9));
    let all = remote.list().await.unwrap();
    assert_eq!(all.len(), 1);
    assert_eq!(all[0].name, "db");
    // An error answer over TLS is still the limit error it stands for.
    assert!(matches!(remote.info("other").await, Ok(None)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_limits_check_the_server_certificate() {
    let (base, _) = tls_endpoint().await;
    // The platform's roots do not include a self-signed certificate.
    let remote = RemoteLimits::new(base).unwrap();
    match remote.list().await {
        Err(LimitError::Backend(message)) => {
            let message = message.message().to_lowercase();
            assert!(message.contains("certificate"), "{message}");
        }
        other => panic!("a self-signed certificate is refused, got {other:?}"),
    }
}
