//! Rank arithmetic on a device mesh: coordinates and the groups collectives run over.

/// Extent of each mesh axis; rank numbers are row-major over the coordinates.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MeshShape(pub Vec<usize>);

impl MeshShape {
    /// Number of ranks.
    pub fn ranks(&self) -> usize {
        self.0.iter().product()
    }

    /// Coordinates of `rank`.
    pub fn coords(&self, rank: usize) -> Vec<usize> {
        let mut coords = vec![0; self.0.len()];
        let mut rest = rank;
        for (axis, &extent) in self.0.iter().enumerate().rev() {
            coords[axis] = rest % extent;
            rest /= extent;
        }
        coords
    }

    /// The rank at `coords`.
    pub fn rank(&self, coords: &[usize]) -> usize {
        coords.iter().zip(&self.0).fold(0, |acc, (&c, &e)| acc * e + c)
    }

    /// The ranks that share `rank`'s coordinates on every axis not in `axes`, ordered
    /// row-major over `axes` (in the order given): the group of a collective over `axes`.
    pub fn group(&self, rank: usize, axes: &[usize]) -> Vec<usize> {
        let base = self.coords(rank);
        let mut members = vec![base.clone()];
        for &axis in axes {
            members = members
                .into_iter()
                .flat_map(|c| {
                    (0..self.0[axis]).map(move |i| {
                        let mut c = c.clone();
                        c[axis] = i;
                        c
                    })
                })
                .collect();
        }
        members.iter().map(|c| self.rank(c)).collect()
    }
}
