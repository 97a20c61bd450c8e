//! The router's HTTP client to its nodes: hyper's pooled HTTP/1 client with nothing between a call and the connection (rustls for `https://` nodes), one per I/O thread.
//!
//! reqwest, used before, parsed every URL twice more and ran each call
//! through redirect and retry layers that a POST to a node never wants:
//! about a fifth of the router's user-space instructions per request
//! (callgrind, local path). What it did that the router needs is here:
//! connect timeout, keep-alive pool, TCP_NODELAY, the upstream key on every
//! call that carries no client's own, the `upstream_ca_file` roots.

use axum::body::Bytes;
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE};
use axum::http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, Uri};
use http_body_util::{BodyExt, Full};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crate::config::{self, RouterConfig};

/// A node's answer; its body arrives as it is read.
pub(crate) type Answer = Response<hyper::body::Incoming>;

/// Why a call got no answer.
#[derive(Debug)]
pub(crate) struct CallError {
    pub message: String,
    /// The connection could not be made: nothing was sent.
    pub connect: bool,
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// The client of every node call (a cheap clone: the pool is shared).
#[derive(Clone)]
pub(crate) struct NodeClient {
    inner: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    /// `Bearer <upstream_api_key>`, on each call that carries no client's own.
    authorization: Option<HeaderValue>,
}

impl NodeClient {
    /// A client for `cfg`'s nodes. With `upstream_api_key` it sends
    /// `Authorization: Bearer <key>` on each call (completions, health checks,
    /// `/metrics` scrapes, `/v1/models`); `https://` nodes are reached over
    /// rustls with the public web roots and, with `upstream_ca_file`, its CAs.
    pub(crate) fn new(cfg: &RouterConfig) -> Result<NodeClient, String> {
        let authorization = match cfg.upstream_secret.get() {
            Some(key) => {
                let mut v = HeaderValue::from_str(&format!("Bearer {key}")).map_err(|_| {
                    "invalid setting `upstream_api_key`: not a header value".to_owned()
                })?;
                v.set_sensitive(true);
                Some(v)
            }
            None => None,
        };
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        http.set_connect_timeout(Some(Duration::from_secs_f64(cfg.connect_timeout)));
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls_config(cfg.upstream_ca_file.as_deref())?)
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        let inner = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .pool_max_idle_per_host(1024)
            .build(https);
        Ok(NodeClient {
            inner,
            authorization,
        })
    }

    /// POSTs a JSON `body` to `uri` with `headers` (plus the upstream key
    /// when they hold no `Authorization`); resolves at the answer's head.
    pub(crate) async fn post_json(
        &self,
        uri: Uri,
        mut headers: HeaderMap,
        body: Bytes,
    ) -> Result<Answer, CallError> {
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        self.call(Method::POST, uri, headers, Full::new(body)).await
    }

    /// The status of a GET of `url`, at the answer's head: a health check
    /// does not wait for a body (some servers send one without framing).
    pub(crate) fn status(
        &self,
        url: &str,
    ) -> impl Future<Output = Result<StatusCode, CallError>> + '_ {
        let head = self.get_head(url);
        async move { Ok(head.await?.status()) }
    }

    /// GETs `url` and reads its whole body (the future does not borrow `url`).
    pub(crate) fn get(
        &self,
        url: &str,
    ) -> impl Future<Output = Result<(StatusCode, Bytes), CallError>> + '_ {
        let head = self.get_head(url);
        async move {
            let resp = head.await?;
            let status = resp.status();
            Ok((status, read_body(resp).await?))
        }
    }

    /// A GET of `url`, resolved at the answer's head.
    fn get_head(&self, url: &str) -> impl Future<Output = Result<Answer, CallError>> + '_ {
        let uri = url.parse::<Uri>().map_err(|e| CallError {
            message: format!("{url}: {e}"),
            connect: true,
        });
        async move {
            self.call(Method::GET, uri?, HeaderMap::new(), Full::default())
                .await
        }
    }

    async fn call(
        &self,
        method: Method,
        uri: Uri,
        mut headers: HeaderMap,
        body: Full<Bytes>,
    ) -> Result<Answer, CallError> {
        if let Some(a) = &self.authorization {
            headers.entry(AUTHORIZATION).or_insert_with(|| a.clone());
        }
        let mut req = Request::new(body);
        *req.method_mut() = method;
        *req.uri_mut() = uri;
        *req.headers_mut() = headers;
        self.inner.request(req).await.map_err(|e| CallError {
            connect: e.is_connect(),
            message: error_chain(&e),
        })
    }
}

/// The `Host` header hyper's client writes for `uri` (its host, and its port
/// unless the scheme's default), for a node's calls to carry from the start:
/// built once per node instead of by hyper on each call (a `format!` and a
/// header value, ~2,200 instructions of the local path's request).
pub(crate) fn host_header(uri: &Uri) -> Option<HeaderValue> {
    let host = uri.host()?;
    let secure = matches!(uri.scheme_str(), Some("https" | "wss"));
    match uri.port() {
        Some(p) if !matches!((p.as_u16(), secure), (443, true) | (80, false)) => {
            HeaderValue::from_str(&format!("{host}:{p}")).ok()
        }
        _ => HeaderValue::from_str(host).ok(),
    }
}

/// The whole body of an answer.
pub(crate) async fn read_body(resp: Answer) -> Result<Bytes, CallError> {
    match resp.into_body().collect().await {
        Ok(b) => Ok(b.to_bytes()),
        Err(e) => Err(CallError {
            message: error_chain(&e),
            connect: false,
        }),
    }
}

/// An error and its causes on one line ("client error (Connect): tcp
/// connect error: Connection refused"), as an operator needs to read it.
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cause = c.source();
    }
    s
}

/// TLS to `https://` nodes: the public web roots, plus `ca_file`'s.
fn tls_config(ca_file: Option<&str>) -> Result<rustls::ClientConfig, String> {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(path) = ca_file {
        for cert in config::read_ca_file(path)
            .map_err(|e| format!("invalid setting `upstream_ca_file`: {e}"))?
        {
            roots
                .add(cert)
                .map_err(|e| format!("invalid setting `upstream_ca_file`: {path}: {e}"))?;
        }
    }
    // ring: the provider the tree already builds (rustls deprecates it only
    // for lacking post-quantum key exchange).
    #[allow(deprecated)]
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A one-answer-per-connection HTTPS node on 127.0.0.1 with a self-signed
    /// certificate for `localhost`: answers 200 and sends back the
    /// `Authorization` line it got (or `none`). Returns its port and the
    /// certificate's PEM.
    // ring, the provider the client's rustls uses here (rustls deprecates it
    // for lacking post-quantum key exchange, irrelevant to a test node).
    #[allow(deprecated)]
    async fn tls_node() -> (u16, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let pem = cert.pem();
        let server = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )
        .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let mut head = Vec::new();
                    let mut buf = [0u8; 1024];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match tls.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    let head = String::from_utf8_lossy(&head).to_lowercase();
                    let auth = head
                        .lines()
                        .find_map(|l| l.strip_prefix("authorization: "))
                        .unwrap_or("none")
                        .to_owned();
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{auth}",
                        auth.len()
                    );
                    let _ = tls.write_all(answer.as_bytes()).await;
                    let _ = tls.shutdown().await;
                });
            }
        });
        (port, pem)
    }

    #[test]
    fn host_headers_are_what_hyper_would_write() {
        let host = |u: &str| host_header(&u.parse().unwrap()).unwrap();
        assert_eq!(
            host("http://127.0.0.1:8000/v1/completions"),
            "127.0.0.1:8000"
        );
        assert_eq!(host("http://node/v1/completions"), "node");
        assert_eq!(host("http://node:80/v1/completions"), "node");
        assert_eq!(host("https://node:443/v1/completions"), "node");
        assert_eq!(host("https://node:80/v1/completions"), "node:80");
        assert_eq!(host("http://node:443/v1/completions"), "node:443");
        assert_eq!(host("http://[::1]:9000/v1/completions"), "[::1]:9000");
        assert!(host_header(&"/v1/completions".parse().unwrap()).is_none());
    }

    fn settings_with(mutate: impl FnOnce(&mut RouterConfig)) -> RouterConfig {
        let mut c = RouterConfig::default();
        mutate(&mut c);
        c.validate().unwrap().config().clone()
    }

    #[tokio::test]
    async fn https_nodes_are_reached_with_the_ca_file_and_the_upstream_key() {
        let (port, pem) = tls_node().await;
        let dir = std::env::temp_dir().join(format!("ppd-tls-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ca = dir.join("ca.pem");
        std::fs::write(&ca, &pem).unwrap();
        let url = format!("https://localhost:{port}/health");
        let node = format!("https://localhost:{port}");

        // The node's certificate is trusted through upstream_ca_file; the
        // upstream key goes on every call the client makes.
        let cfg = settings_with(|c| {
            c.replica = vec![node.clone()];
            c.upstream_ca_file = Some(ca.display().to_string());
            c.upstream_api_key = Some("node-key".into());
        });
        let (status, body) = NodeClient::new(&cfg).unwrap().get(&url).await.unwrap();
        assert_eq!(status, 200);
        assert_eq!(body, "bearer node-key");

        // Without the key, nothing; without the CA, the handshake fails.
        let cfg = settings_with(|c| c.upstream_ca_file = Some(ca.display().to_string()));
        let (_, body) = NodeClient::new(&cfg).unwrap().get(&url).await.unwrap();
        assert_eq!(body, "none");
        let untrusting = NodeClient::new(&RouterConfig::default()).unwrap();
        let e = untrusting.get(&url).await.unwrap_err();
        assert!(e.connect, "{e:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
