//! A client of the node link: what `mirrorq` tools and the tests use to talk
//! to a running node without AMQP. Any node answers; it forwards to masters.

use std::time::Duration;

use crate::api::QueueInfo;
use crate::error::NodeError;
use crate::ids::NodeId;
use crate::link::transport::{CallError, Transport};
use crate::metadata::QueueMeta;
use crate::queue::{Delivery, Message, QueueCmd, QueueReply};
use crate::wire::ask::Ask;
use crate::wire::{ClientReply, ClientRequest, RpcRequest};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error(transparent)]
    Call(#[from] CallError),
    #[error(transparent)]
    Node(#[from] NodeError),
    #[error("unexpected reply: {0}")]
    Unexpected(String),
}

pub struct NodeClient {
    addr: String,
    transport: Transport,
    timeout: Duration,
}

impl NodeClient {
    pub fn new(addr: impl Into<String>) -> Self {
        Self { addr: addr.into(), transport: Transport::new(), timeout: Duration::from_secs(30) }
    }

    /// A client of a cluster with a secret, proving it on connecting.
    pub fn with_secret(addr: impl Into<String>, secret: crate::link::auth::ClusterSecret) -> Self {
        Self { transport: Transport::new().with_secret(Some(secret)), ..Self::new(addr) }
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    async fn request(&self, req: ClientRequest) -> Result<ClientReply, ClientError> {
        let answer = self.transport.call(&self.addr, &RpcRequest::from(req), self.timeout).await?;
        match ClientRequest::reply(answer) {
            Ok(r) => Ok(r?),
            Err(other) => Err(ClientError::Unexpected(format!("{other:?}"))),
        }
    }

    pub async fn declare_queue(&self, name: &str, replicas: Vec<NodeId>) -> Result<QueueMeta, ClientError> {
        match self.request(ClientRequest::DeclareQueue { name: name.into(), replicas }).await? {
            ClientReply::Declared(q) => Ok(q),
            other => Err(ClientError::Unexpected(format!("{other:?}"))),
        }
    }

    pub async fn queue_info(&self, name: &str) -> Result<QueueInfo, ClientError> {
        match self.request(ClientRequest::QueueInfo { name: name.into(), declared: false }).await? {
            ClientReply::QueueInfo(q) => Ok(*q),
            other => Err(ClientError::Unexpected(format!("{other:?}"))),
        }
    }

    pub async fn queue_op(&self, queue: &str, cmds: Vec<QueueCmd>) -> Result<Vec<QueueReply>, ClientError> {
        match self.request(ClientRequest::QueueOp { queue: queue.into(), cmds }).await? {
            ClientReply::Queue(r) => Ok(r),
            other => Err(ClientError::Unexpected(format!("{other:?}"))),
        }
    }

    /// Publish and wait for the confirm.
    pub async fn publish(&self, queue: &str, msgs: Vec<Message>) -> Result<(), ClientError> {
        self.queue_op(queue, vec![QueueCmd::Enqueue { msgs }]).await.map(|_| ())
    }

    pub async fn get(&self, queue: &str, owner: u64, max: u32, auto_ack: bool) -> Result<Vec<Delivery>, ClientError> {
        match self.queue_op(queue, vec![QueueCmd::Get { owner, max, auto_ack, consumer: None }]).await?.pop() {
            Some(QueueReply::Got { msgs, .. }) => Ok(msgs),
            other => Err(ClientError::Unexpected(format!("{other:?}"))),
        }
    }
}
