//! [`Groups`]: what a rank makes its process groups from, so that code
//! which builds groups from a configuration (the engine's
//! `Engine::from_config`) runs the same over a real job ([`Dist`]) and
//! over in-process ranks ([`LocalRank`]).

use crate::local::{LocalGroup, LocalRank};
use crate::{CommError, DeviceMesh, Dist, Group, ProcessGroup};

/// A rank's membership in a world, and the way to make its sub-groups.
///
/// Making a group is collective: every member makes it, in the same order.
pub trait Groups {
    /// The groups this source makes.
    type Group: ProcessGroup + 'static;

    /// This rank's index in the world.
    fn world_rank(&self) -> usize;

    /// Ranks in the world.
    fn world_size(&self) -> usize;

    /// A group of the given world ranks (in that order), which this rank
    /// belongs to.
    fn new_group(&mut self, ranks: &[usize]) -> Result<Self::Group, CommError>;

    /// This rank's view of a (replicate x shard) mesh over the world.
    fn mesh(&mut self, shard_size: usize) -> Result<DeviceMesh<Self::Group>, CommError>;

    /// The group of every rank, made as a new group (its own sequence of
    /// operations, apart from the world's).
    fn everyone(&mut self) -> Result<Self::Group, CommError> {
        let all: Vec<usize> = (0..self.world_size()).collect();
        self.new_group(&all)
    }
}

impl Groups for Dist {
    type Group = Group;
    fn world_rank(&self) -> usize {
        self.env().rank
    }
    fn world_size(&self) -> usize {
        self.env().world_size
    }
    fn new_group(&mut self, ranks: &[usize]) -> Result<Group, CommError> {
        Dist::new_group(self, ranks)
    }
    fn mesh(&mut self, shard_size: usize) -> Result<DeviceMesh<Group>, CommError> {
        Dist::mesh(self, shard_size)
    }
}

impl Groups for LocalRank {
    type Group = LocalGroup;
    fn world_rank(&self) -> usize {
        self.rank()
    }
    fn world_size(&self) -> usize {
        self.world().size()
    }
    fn new_group(&mut self, ranks: &[usize]) -> Result<LocalGroup, CommError> {
        LocalRank::new_group(self, ranks)
    }
    fn mesh(&mut self, shard_size: usize) -> Result<DeviceMesh<LocalGroup>, CommError> {
        LocalRank::mesh(self, shard_size)
    }
}
