//! The cluster secret: every node-link connection (Raft traffic, forwarded
//! operations and beacon pings alike) opens with a mutual challenge-response
//! that proves both ends know the same secret, as RabbitMQ's Erlang cookie
//! does for its nodes. The secret never crosses the wire, and each side's
//! proof covers a nonce the other side just drew, so a recorded exchange
//! proves nothing later.
//!
//! ```text
//! dialler  -> MAGIC (8) | dialler nonce (32)
//! listener -> listener nonce (32) | HMAC(secret, "listener" | both nonces)
//! dialler  -> HMAC(secret, "dialler" | both nonces)
//! listener -> 1 (accepted)
//! ```
//!
//! The listener proves itself first, so a dialler with another secret learns
//! that it is the secrets that differ, not merely that it was cut off. Its
//! proof answers a nonce the dialler chose, but under another label than the
//! dialler's: it can never be replayed as one.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// What an authenticated connection opens with; no frame of the node link
/// or beacon starts with it.
pub const MAGIC: &[u8; 8] = b"MQAUTH01";
const NONCE: usize = 32;
const PROOF: usize = 32;
/// A secret shorter than this is a placeholder, not a secret.
pub const MIN_SECRET_BYTES: usize = 16;
/// How long either side waits for the other's part of the exchange.
const STEP_TIMEOUT: Duration = Duration::from_secs(10);

/// The secret every node of a cluster shares.
#[derive(Clone)]
pub struct ClusterSecret(Arc<[u8]>);

impl std::fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterSecret(..)")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("cannot read the cluster secret file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the cluster secret file {0} must be readable by its owner only (chmod 600), as an Erlang cookie")]
    Exposed(PathBuf),
    #[error("the cluster secret in {path} is {len} bytes; it needs at least {MIN_SECRET_BYTES}")]
    Short { path: PathBuf, len: usize },
}

impl ClusterSecret {
    /// The secret in `path`, without trailing whitespace (an editor's
    /// newline). The file must be its owner's alone and the secret long
    /// enough to be one.
    pub fn from_file(path: &Path) -> Result<Self, SecretError> {
        use std::os::unix::fs::PermissionsExt;
        let read = |source| SecretError::Read { path: path.to_owned(), source };
        let mode = std::fs::metadata(path).map_err(read)?.permissions().mode();
        if mode & 0o077 != 0 {
            return Err(SecretError::Exposed(path.to_owned()));
        }
        let bytes = std::fs::read(path).map_err(read)?;
        let len = bytes.iter().rposition(|b| !b.is_ascii_whitespace()).map_or(0, |i| i + 1);
        if len < MIN_SECRET_BYTES {
            return Err(SecretError::Short { path: path.to_owned(), len });
        }
        Ok(Self(Arc::from(&bytes[..len])))
    }

    /// A secret given as bytes (tests, tools).
    pub fn new(bytes: impl AsRef<[u8]>) -> Self {
        Self(Arc::from(bytes.as_ref()))
    }

    fn proof(&self, label: &[u8], dialler: &[u8; NONCE], listener: &[u8; NONCE]) -> Hmac<Sha256> {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes a key of any length");
        mac.update(label);
        mac.update(dialler);
        mac.update(listener);
        mac
    }
}

/// Why a connection was not authenticated.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("the peer's cluster secret differs from ours")]
    SecretDiffers,
    #[error(
        "the peer did not open with the cluster-secret handshake (a node without --cluster-secret-file, or not a node)"
    )]
    NoHandshake,
    #[error("the peer refused our cluster secret")]
    Refused,
    #[error("the handshake timed out")]
    Timeout,
    #[error("the connection failed during the handshake: {0}")]
    Io(#[from] std::io::Error),
}

async fn step<T>(f: impl std::future::Future<Output = std::io::Result<T>>) -> Result<T, AuthError> {
    match tokio::time::timeout(STEP_TIMEOUT, f).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(AuthError::Timeout),
    }
}

fn nonce() -> [u8; NONCE] {
    let mut n = [0u8; NONCE];
    rand::rngs::OsRng.fill_bytes(&mut n);
    n
}

/// The dialler's side: prove we know `secret` and check that the listener does.
pub async fn dial<S: AsyncRead + AsyncWrite + Unpin>(stream: &mut S, secret: &ClusterSecret) -> Result<(), AuthError> {
    let mine = nonce();
    let mut hello = [0u8; MAGIC.len() + NONCE];
    hello[..MAGIC.len()].copy_from_slice(MAGIC);
    hello[MAGIC.len()..].copy_from_slice(&mine);
    step(stream.write_all(&hello)).await?;
    let mut answer = [0u8; NONCE + PROOF];
    match step(stream.read_exact(&mut answer)).await {
        Ok(_) => {}
        // Closed on our hello: a listener that takes no handshake.
        Err(AuthError::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Err(AuthError::NoHandshake),
        Err(e) => return Err(e),
    }
    let theirs: [u8; NONCE] = answer[..NONCE].try_into().expect("sized");
    secret.proof(b"listener", &mine, &theirs).verify_slice(&answer[NONCE..]).map_err(|_| AuthError::SecretDiffers)?;
    let proof = secret.proof(b"dialler", &mine, &theirs).finalize().into_bytes();
    step(stream.write_all(&proof)).await?;
    let mut verdict = [0u8; 1];
    match step(stream.read_exact(&mut verdict)).await {
        Ok(_) if verdict[0] == 1 => Ok(()),
        Ok(_) => Err(AuthError::Refused),
        Err(AuthError::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => Err(AuthError::Refused),
        Err(e) => Err(e),
    }
}

/// The listener's side: check that the dialler knows `secret`, proving we do.
pub async fn accept<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    secret: &ClusterSecret,
) -> Result<(), AuthError> {
    let mut hello = [0u8; MAGIC.len() + NONCE];
    step(stream.read_exact(&mut hello[..MAGIC.len()])).await?;
    if &hello[..MAGIC.len()] != MAGIC {
        return Err(AuthError::NoHandshake);
    }
    step(stream.read_exact(&mut hello[MAGIC.len()..])).await?;
    let theirs: [u8; NONCE] = hello[MAGIC.len()..].try_into().expect("sized");
    let mine = nonce();
    let mut answer = [0u8; NONCE + PROOF];
    answer[..NONCE].copy_from_slice(&mine);
    answer[NONCE..].copy_from_slice(&secret.proof(b"listener", &theirs, &mine).finalize().into_bytes());
    step(stream.write_all(&answer)).await?;
    let mut proof = [0u8; PROOF];
    step(stream.read_exact(&mut proof)).await?;
    if secret.proof(b"dialler", &theirs, &mine).verify_slice(&proof).is_err() {
        let _ = step(stream.write_all(&[0])).await;
        return Err(AuthError::SecretDiffers);
    }
    step(stream.write_all(&[1])).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn pair(a: &ClusterSecret, b: &ClusterSecret) -> (Result<(), AuthError>, Result<(), AuthError>) {
        let (mut x, mut y) = tokio::io::duplex(256);
        tokio::join!(dial(&mut x, a), accept(&mut y, b))
    }

    #[tokio::test]
    async fn both_ends_pass_with_the_same_secret_and_neither_with_another() {
        let s = ClusterSecret::new("a secret of some length");
        let (d, l) = pair(&s, &s).await;
        assert!(d.is_ok() && l.is_ok(), "{d:?} {l:?}");
        let (d, l) = pair(&s, &ClusterSecret::new("another secret, as long")).await;
        assert!(matches!(d, Err(AuthError::SecretDiffers)), "{d:?}");
        assert!(l.is_err(), "the listener let a dialler in that never proved itself");
    }

    /// What a listener sends for one dialler nonce is no proof for another
    /// exchange: a recorded answer replayed by a dialler that lacks the
    /// secret is refused.
    #[tokio::test]
    async fn a_recorded_proof_is_refused() {
        let s = ClusterSecret::new("a secret of some length");
        let (mut x, mut y) = tokio::io::duplex(256);
        let listener = tokio::spawn(async move { accept(&mut y, &s).await });
        let mut hello = MAGIC.to_vec();
        hello.extend_from_slice(&[7u8; NONCE]);
        x.write_all(&hello).await.unwrap();
        let mut answer = [0u8; NONCE + PROOF];
        x.read_exact(&mut answer).await.unwrap();
        // The best a dialler without the secret has: the listener's own proof.
        x.write_all(&answer[NONCE..]).await.unwrap();
        assert!(matches!(listener.await.unwrap(), Err(AuthError::SecretDiffers)));
        let mut verdict = [9u8; 1];
        x.read_exact(&mut verdict).await.unwrap();
        assert_eq!(verdict[0], 0);
    }

    #[test]
    fn a_secret_file_must_be_private_and_long_enough() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        std::fs::write(&path, "0123456789abcdef\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(ClusterSecret::from_file(&path), Err(SecretError::Exposed(_))));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let s = ClusterSecret::from_file(&path).unwrap();
        assert_eq!(&*s.0, b"0123456789abcdef", "the trailing newline is no part of it");
        std::fs::write(&path, "short\n").unwrap();
        assert!(matches!(ClusterSecret::from_file(&path), Err(SecretError::Short { len: 5, .. })));
        assert!(matches!(ClusterSecret::from_file(&dir.path().join("none")), Err(SecretError::Read { .. })));
    }
}
