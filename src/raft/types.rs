//! openraft's type configuration for one kind of group, generic over what
//! its entries carry and what applying one answers. Queue groups and the
//! metadata group each have their own (`queue::QueueTypes`,
//! `metadata::MetaTypes`): a queue's log cannot hold a metadata command,
//! and this module names neither.

use std::cmp::Ordering;
use std::fmt;
use std::io::Cursor;
use std::marker::PhantomData;

use openraft::{AppData, AppDataResponse, RaftTypeConfig};

use crate::ids::NodeId;

/// The types of a group whose entries carry `D` and whose applies answer
/// `R`. Only a marker: openraft wants it copyable, comparable and
/// defaultable whatever `D` and `R` are, hence the impls by hand.
pub struct Group<D, R>(PhantomData<fn() -> (D, R)>);

impl<D, R> Clone for Group<D, R> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<D, R> Copy for Group<D, R> {}
impl<D, R> Default for Group<D, R> {
    fn default() -> Self {
        Self(PhantomData)
    }
}
impl<D, R> fmt::Debug for Group<D, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Group")
    }
}
impl<D, R> PartialEq for Group<D, R> {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}
impl<D, R> Eq for Group<D, R> {}
impl<D, R> PartialOrd for Group<D, R> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl<D, R> Ord for Group<D, R> {
    fn cmp(&self, _: &Self) -> Ordering {
        Ordering::Equal
    }
}

impl<D: AppData, R: AppDataResponse> RaftTypeConfig for Group<D, R> {
    type D = D;
    type R = R;
    type NodeId = NodeId;
    type Node = openraft::BasicNode;
    type Entry = openraft::impls::Entry<Self>;
    type SnapshotData = Cursor<Vec<u8>>;
    type Responder = openraft::impls::OneshotResponder<Self>;
    type AsyncRuntime = openraft::impls::TokioRuntime;
}
