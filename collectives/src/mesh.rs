//! The 2-D device mesh: world = replicate x shard (DESIGN.md, "Mesh").

use crate::{CommError, ProcessGroup};

/// This rank's groups in a (replicate x shard) mesh.
///
/// A shard group is `shard_size` consecutive ranks (one node, typically);
/// a replicate group is the ranks at the same position in every shard group.
/// Full sharding is `shard_size == world`; hybrid sharding (HSDP, MiCS)
/// shards inside the shard group and all-reduces across the replicate group.
pub struct DeviceMesh<G: ProcessGroup> {
    world_rank: usize,
    world_size: usize,
    shard_size: usize,
    shard: G,
    replicate: G,
}

impl<G: ProcessGroup> DeviceMesh<G> {
    /// Builds this rank's mesh, creating its two groups with `new_group`
    /// (called with world ranks, in group order).
    pub fn new(
        world_rank: usize,
        world_size: usize,
        shard_size: usize,
        mut new_group: impl FnMut(&[usize]) -> Result<G, CommError>,
    ) -> Result<Self, CommError> {
        if shard_size == 0 || world_size % shard_size != 0 {
            return Err(CommError::Invalid {
                group: "mesh".into(),
                call: format!("DeviceMesh(world {world_size}, shard_size {shard_size})"),
                why: format!("shard_size must divide the world size {world_size} (e.g. set mics_shard_size to a divisor)"),
            });
        }
        let (shard_ranks, replicate_ranks) = Self::layout(world_rank, world_size, shard_size);
        let shard = new_group(&shard_ranks)?;
        let replicate = new_group(&replicate_ranks)?;
        Ok(Self {
            world_rank,
            world_size,
            shard_size,
            shard,
            replicate,
        })
    }

    /// The world ranks of `rank`'s shard group and replicate group.
    pub fn layout(rank: usize, world: usize, shard_size: usize) -> (Vec<usize>, Vec<usize>) {
        let base = rank / shard_size * shard_size;
        let shard = (base..base + shard_size).collect();
        let replicate = (rank % shard_size..world).step_by(shard_size).collect();
        (shard, replicate)
    }

    /// The group this rank's parameters are sharded over.
    pub fn shard_group(&self) -> &G {
        &self.shard
    }
    /// The group this rank's shard is replicated over.
    pub fn replicate_group(&self) -> &G {
        &self.replicate
    }
    /// The two groups, (shard, replicate), for whoever drives them.
    pub fn into_groups(self) -> (G, G) {
        (self.shard, self.replicate)
    }
    /// This rank in the world.
    pub fn world_rank(&self) -> usize {
        self.world_rank
    }
    /// Ranks in the world.
    pub fn world_size(&self) -> usize {
        self.world_size
    }
    /// Ranks per shard group.
    pub fn shard_size(&self) -> usize {
        self.shard_size
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::local::LocalGroup;

    #[test]
    fn layout_of_a_2x4_mesh() {
        type M = DeviceMesh<LocalGroup>;
        assert_eq!(M::layout(5, 8, 4), (vec![4, 5, 6, 7], vec![1, 5]));
        assert_eq!(M::layout(0, 8, 4), (vec![0, 1, 2, 3], vec![0, 4]));
        assert_eq!(M::layout(3, 4, 4), (vec![0, 1, 2, 3], vec![3]));
        assert_eq!(M::layout(2, 4, 1), (vec![2], vec![0, 1, 2, 3]));
    }
}
