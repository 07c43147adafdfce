//! TLS for the client surfaces (AMQPS, HTTPS) with rustls: the server's
//! configuration from PEM files, and a listener that hands out connections
//! once their handshake is done.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

/// A client that does not finish its TLS handshake within this is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshakes under way at once; beyond, accepting waits.
const MAX_HANDSHAKES: usize = 256;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {what} {path}: {reason}")]
    Pem { what: &'static str, path: PathBuf, reason: String },
    #[error("{what} {path} holds no {expected}")]
    Empty { what: &'static str, path: PathBuf, expected: &'static str },
    #[error("--tls-verify-peer needs --tls-ca (the CA that signs client certificates)")]
    NoCa,
    #[error("TLS configuration: {0}")]
    Config(#[from] rustls::Error),
    #[error("client certificate verifier: {0}")]
    Verifier(String),
}

/// Where the node's TLS material is (CONTRACT section 2's flags).
#[derive(Debug, Clone, Default)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: Option<PathBuf>,
    /// Require a client certificate signed by `ca`.
    pub verify_peer: bool,
}

fn certs(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = |reason: String| TlsError::Pem { what, path: path.to_owned(), reason };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| pem(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem(e.to_string()))?;
    if certs.is_empty() {
        return Err(TlsError::Empty { what, path: path.to_owned(), expected: "certificate" });
    }
    Ok(certs)
}

impl TlsFiles {
    fn key(&self) -> Result<PrivateKeyDer<'static>, TlsError> {
        PrivateKeyDer::from_pem_file(&self.key).map_err(|e| TlsError::Pem {
            what: "--tls-key",
            path: self.key.clone(),
            reason: e.to_string(),
        })
    }

    /// The certificates of `ca` as trust roots.
    fn roots(ca: &Path) -> Result<Arc<rustls::RootCertStore>, TlsError> {
        let mut roots = rustls::RootCertStore::empty();
        for c in certs("--tls-ca", ca)? {
            roots.add(c).map_err(|e| TlsError::Pem { what: "--tls-ca", path: ca.to_owned(), reason: e.to_string() })?;
        }
        Ok(Arc::new(roots))
    }

    /// The server configuration these files make, for `alpn` protocols.
    pub fn server_config(&self, alpn: &[&[u8]]) -> Result<Arc<rustls::ServerConfig>, TlsError> {
        let chain = certs("--tls-cert", &self.cert)?;
        let key = self.key()?;
        // ring, not aws-lc-rs: aws-lc is a C build of minutes (FACTS.md).
        // rustls deprecates ring's provider for lacking post-quantum key
        // exchange; the classical suites it offers are what RabbitMQ's are.
        #[allow(deprecated)]
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder =
            rustls::ServerConfig::builder_with_provider(provider.clone()).with_safe_default_protocol_versions()?;
        let builder = match (&self.ca, self.verify_peer) {
            (None, true) => return Err(TlsError::NoCa),
            (Some(ca), true) => {
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Self::roots(ca)?, provider)
                    .build()
                    .map_err(|e| TlsError::Verifier(e.to_string()))?;
                builder.with_client_cert_verifier(verifier)
            }
            (_, false) => builder.with_no_client_auth(),
        };
        let mut config = builder.with_single_cert(chain, key)?;
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Ok(Arc::new(config))
    }
}

/// TCP connections whose TLS handshake is done, with their peer address.
/// Handshakes run concurrently (a slow client holds up no other), each
/// bounded in time; failed ones are dropped and logged at debug level (a
/// scanner's probes are no news).
pub struct TlsListener {
    rx: mpsc::Receiver<(TlsStream<TcpStream>, std::net::SocketAddr)>,
    local: std::net::SocketAddr,
}

impl TlsListener {
    pub fn new(
        listener: TcpListener,
        config: Arc<rustls::ServerConfig>,
        stop: CancellationToken,
    ) -> std::io::Result<Self> {
        let local = listener.local_addr()?;
        let (tx, rx) = mpsc::channel(64);
        let acceptor = TlsAcceptor::from(config);
        let slots = Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
        tokio::spawn(async move {
            loop {
                let Ok(slot) = slots.clone().acquire_owned().await else { return };
                let (tcp, peer) = tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tx.closed() => return,
                    a = listener.accept() => match a {
                        Ok(a) => a,
                        Err(e) => {
                            tracing::warn!(error = %e, "accept failed on a TLS port");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                    },
                };
                let _ = tcp.set_nodelay(true);
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    let _slot = slot;
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(tls)) => {
                            let _ = tx.send((tls, peer)).await;
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        Ok(Self { rx, local })
    }

    /// The next connection through its handshake; `None` once stopped.
    pub async fn next(&mut self) -> Option<(TlsStream<TcpStream>, std::net::SocketAddr)> {
        self.rx.recv().await
    }

    pub fn local_addr(&self) -> std::net::SocketAddr {
        self.local
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.next().await {
            Some(c) => c,
            // Stopped: nothing more comes; axum's serve ends with the node.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}

/// TLS on the node link: both ends show the node certificate (`--tls-cert`)
/// and check the other's against `--tls-ca`. Each connection also proves
/// the cluster secret inside it.
pub struct LinkTls {
    pub server: TlsAcceptor,
    pub client: tokio_rustls::TlsConnector,
}

impl std::fmt::Debug for LinkTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LinkTls(..)")
    }
}

/// Both ends of the node link on one stream type, TLS or not.
pub trait LinkIo: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static> LinkIo for T {}

impl LinkTls {
    /// Dial with TLS, checking that the peer's certificate names the host
    /// we dialled (an IP address or a name).
    pub async fn connect(&self, addr: &str, tcp: TcpStream) -> std::io::Result<Box<dyn LinkIo>> {
        let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h).trim_start_matches('[').trim_end_matches(']');
        let name = rustls::pki_types::ServerName::try_from(host.to_string())
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        let tls = tokio::time::timeout(HANDSHAKE_TIMEOUT, self.client.connect(name, tcp))
            .await
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "TLS handshake timed out"))??;
        Ok(Box::new(tls))
    }

    /// Take a dialler's TLS handshake.
    pub async fn accept(&self, tcp: TcpStream) -> std::io::Result<Box<dyn LinkIo>> {
        let tls = tokio::time::timeout(HANDSHAKE_TIMEOUT, self.server.accept(tcp))
            .await
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "TLS handshake timed out"))??;
        Ok(Box::new(tls))
    }
}

impl TlsFiles {
    /// Mutual TLS for the node link from these files; `--tls-ca` required.
    pub fn link_tls(&self) -> Result<LinkTls, TlsError> {
        let ca = self.ca.as_ref().ok_or(TlsError::NoCa)?;
        let server = Self { verify_peer: true, ..self.clone() }.server_config(&[])?;
        #[allow(deprecated)] // as in `server_config`
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let client = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(Self::roots(ca)?)
            .with_client_auth_cert(certs("--tls-cert", &self.cert)?, self.key()?)?;
        Ok(LinkTls { server: TlsAcceptor::from(server), client: tokio_rustls::TlsConnector::from(Arc::new(client)) })
    }
}
