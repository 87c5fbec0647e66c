"""Group-relative advantages (design §5).

Rows are prompt-major: the `n` samples of prompt `i` are rows `i*n .. i*n + n - 1` of the rollout batch, which is
how the loop lays out a global step. The advantage is one number per row; the loss broadcasts it over tokens.

Choices, stated once:
- std is the *unbiased* group standard deviation (ddof=1) by default, as in the reference GRPO recipe (verl);
  `grpo.adv_std: population` takes ddof=0 (TRL's GRPOTrainer). With n samples the two differ by the factor
  sqrt(n/(n-1)) on every non-constant group (1.069 at n=8): a uniform rescale of the advantages, which Adam
  largely absorbs but the KL term (whose weight is relative to the policy term) does not;
- a group whose rewards are all equal (std ≈ 0), or a group of one sample, carries no preference signal: its
  advantages are exactly 0 (not a ±ulp residue of `r - mean`), so it contributes nothing to the policy gradient.
"""

from __future__ import annotations

import jax.numpy as jnp

# Below this std a group is treated as constant. Rewards are O(1) and verifier outputs are often exactly equal,
# in which case the float std is exactly 0 or a few ulp; 1e-8 separates those from any real spread.
_ZERO_STD = 1e-8


def group_advantages(rewards, n: int, std_normalize: bool = True, eps: float = 1e-6, ddof: int = 1):
    """Per-group advantage. rewards [P*n] -> advantages [P*n] float32.

    A_i = (r_i - mean_g) / (std_g + eps) when `std_normalize`, else r_i - mean_g; 0 for constant groups.
    std_g uses `ddof` (1: unbiased, 0: population). Pure jnp, jittable (`n`, `std_normalize`, `ddof` static).
    """
    if ddof not in (0, 1):
        raise ValueError(f"ddof must be 0 (population) or 1 (unbiased), got {ddof}")
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D [P*n], got shape {rewards.shape}")
    if n < 1 or rewards.shape[0] % n != 0:
        raise ValueError(f"rewards length {rewards.shape[0]} is not a multiple of the group size n={n}")
    groups = rewards.reshape(-1, n)  # [P, n]
    mean = groups.mean(axis=1, keepdims=True)  # [P, 1]
    centred = groups - mean
    if n > 1:
        std = jnp.sqrt(jnp.sum(centred * centred, axis=1, keepdims=True) / (n - ddof))
    else:
        std = jnp.zeros_like(mean)
    adv = centred / (std + eps) if std_normalize else centred
    adv = jnp.where(std > _ZERO_STD, adv, 0.0)
    return adv.reshape(-1)
