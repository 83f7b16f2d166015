"""Grouped matmuls: rows sorted into consecutive groups, each group
multiplied by its own matrix, [M, K] x [G, K, N] -> [M, N], group g being
the next group_sizes[g] rows.

`KERNELS` holds them by name (`MixtureOfExperts.kernel`):

- `ragged_dot`: `jax.lax.ragged_dot`, XLA's own. On the CPU it is the
  reference; XLA:GPU in jax 0.10 lowers it to a product with every group's
  matrix (G times the FLOPs), so GPU runs need a kernel of their own.
"""

from __future__ import annotations

import jax


def ragged_dot(x_MK, w_GKN, group_sizes_G):
    """Rows [M, K] by their groups' matrices [G, K, N]; group sizes [G] int32 summing to M."""
    return jax.lax.ragged_dot(x_MK, w_GKN, group_sizes_G)


KERNELS = {"ragged_dot": ragged_dot}
