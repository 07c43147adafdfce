//! mirrorq patch: tokio's unbounded channels with each message boxed.
//!
//! A tokio channel allocates its first block of 32 slots when it is made,
//! each slot the size of the message: 150-230 bytes for the core's, so each
//! Raft instance held about 18 KiB in empty channel blocks. With ten
//! thousand groups on a node that was a quarter of the memory per group.
//! Boxed, a slot is a pointer. The API is the subset of tokio's that
//! openraft uses, so a file switches with its `use` line.

use tokio::sync::mpsc as tokio_mpsc;
pub(crate) use tokio_mpsc::error;

pub(crate) fn unbounded_channel<T>() -> (UnboundedSender<T>, UnboundedReceiver<T>) {
    let (tx, rx) = tokio_mpsc::unbounded_channel();
    (UnboundedSender(tx), UnboundedReceiver(rx))
}

pub(crate) struct UnboundedSender<T>(tokio_mpsc::UnboundedSender<Box<T>>);

impl<T> Clone for UnboundedSender<T> {
    fn clone(&self) -> Self {
        UnboundedSender(self.0.clone())
    }
}

impl<T> std::fmt::Debug for UnboundedSender<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl<T> UnboundedSender<T> {
    pub(crate) fn send(&self, message: T) -> Result<(), error::SendError<T>> {
        self.0.send(Box::new(message)).map_err(|e| error::SendError(*e.0))
    }

    pub(crate) fn downgrade(&self) -> WeakUnboundedSender<T> {
        WeakUnboundedSender(self.0.downgrade())
    }
}

pub(crate) struct WeakUnboundedSender<T>(tokio_mpsc::WeakUnboundedSender<Box<T>>);

impl<T> Clone for WeakUnboundedSender<T> {
    fn clone(&self) -> Self {
        WeakUnboundedSender(self.0.clone())
    }
}

impl<T> std::fmt::Debug for WeakUnboundedSender<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl<T> WeakUnboundedSender<T> {
    pub(crate) fn upgrade(&self) -> Option<UnboundedSender<T>> {
        self.0.upgrade().map(UnboundedSender)
    }
}

pub(crate) struct UnboundedReceiver<T>(tokio_mpsc::UnboundedReceiver<Box<T>>);

impl<T> std::fmt::Debug for UnboundedReceiver<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl<T> UnboundedReceiver<T> {
    pub(crate) async fn recv(&mut self) -> Option<T> {
        self.0.recv().await.map(|b| *b)
    }

    pub(crate) fn try_recv(&mut self) -> Result<T, error::TryRecvError> {
        self.0.try_recv().map(|b| *b)
    }
}
