//! Inbound node-to-node traffic: accepts peers' connections and hands each
//! request to the node, answering on the same connection in any order.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use futures::StreamExt;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_util::codec::FramedRead;
use tokio_util::sync::CancellationToken;

use super::rpc::{self, Envelope, RpcRequest, RpcResponse};
use super::transport::{codec, write_frames};

/// The rest of a request's handling, after its admission.
pub type Completion = Pin<Box<dyn Future<Output = RpcResponse> + Send>>;

/// Whatever answers requests arriving on the node link (the node).
pub trait RpcHandler: Send + Sync + 'static {
    /// Admit a request, in arrival order (queue operations take their place
    /// in the master's log order here), and return the rest of its handling,
    /// which runs concurrently with later requests.
    fn admit(self: Arc<Self>, req: RpcRequest) -> impl Future<Output = Completion> + Send;
}

/// Accept connections until `stop` is cancelled; then every connection and
/// in-flight handler is dropped.
pub async fn serve<H: RpcHandler>(listener: TcpListener, handler: Arc<H>, stop: CancellationToken) {
    loop {
        let accepted = tokio::select! {
            _ = stop.cancelled() => return,
            a = listener.accept() => a,
        };
        match accepted {
            Ok((stream, _)) => {
                let _ = stream.set_nodelay(true);
                let (h, stop) = (handler.clone(), stop.clone());
                tokio::spawn(async move {
                    tokio::select! {
                        _ = stop.cancelled() => {}
                        _ = connection(stream, h, stop.clone()) => {}
                    }
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "accept failed on the raft port");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    }
}

async fn connection<H: RpcHandler>(stream: tokio::net::TcpStream, handler: Arc<H>, stop: CancellationToken) {
    let (rd, wr) = stream.into_split();
    let (tx, rx) = mpsc::channel::<Bytes>(1024);
    let writer = tokio::spawn(write_frames(wr, rx));
    let mut input = FramedRead::new(rd, codec());
    while let Some(Ok(frame)) = input.next().await {
        let env: Envelope<RpcRequest> = match rpc::decode(&frame) {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!(error = %e, "undecodable request on the raft port; closing the connection");
                break;
            }
        };
        let completion = handler.clone().admit(env.body).await;
        let (tx, stop) = (tx.clone(), stop.clone());
        tokio::spawn(async move {
            let body = tokio::select! {
                _ = stop.cancelled() => return,
                b = completion => b,
            };
            match rpc::encode(&Envelope::<RpcResponse> { id: env.id, body }) {
                Ok(b) => {
                    let _ = tx.send(Bytes::from(b)).await;
                }
                Err(e) => tracing::error!(error = %e, "cannot encode a reply"),
            }
        });
    }
    drop(tx);
    writer.abort();
}
