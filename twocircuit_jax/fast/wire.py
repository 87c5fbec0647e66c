"""What crosses a real stage boundary (parallel/pipeline.py): each codec's packed payload, not a masked dense tensor.

A `Wire` is one boundary's format for one microbatch: `encode(h [mb, T, H]) -> payload` at the sending stage,
`decode(payload) -> h̃` at the receiving one, with decode(encode(h)) equal, bit for bit, to the codec's emulated
hook (the one-program path of fast/codecs). `transfer` runs encode on the sender only, moves the payload with the
pipeline's `ppermute`, and decodes on the receiver only (the other stages skip both under `lax.cond`).

The backward message is the cotangent of the payload, moved by the transposed `ppermute`: for the linear formats
(dense, the PRF mask, the low-rank coefficients) autodiff already makes it the same size as the forward one, k
values or r coefficients per token, and equal to the emulated path's gradient. A format whose backward must be
encoded on its own (stochastic rounding draws fresh bits for the gradient) overrides `transfer` with a custom VJP.

Formats (per token and boundary):
  dense      H values
  prf_mask   k = round((1-p) H) values in channel order; both sides regenerate the kept channels from the PRF key,
             so no index is sent (exact-k only: a Bernoulli mask sends a varying count)
  lowrank    r coefficients Y = h·Q (the basis Q is replicated state, never sent per step)
  sr_quant   H codes of b bits packed 8/b to a byte (subset_k: only the k subset channels' codes), plus one fp32
             scale per block; the backward message is the cotangent quantized on its own with fresh PRF bits
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.lowrank import lowrank_reference


def _zeros(like):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), like)


class Wire:
    """Base format: subclasses define `encode` and `decode` (or override `transfer`)."""

    def encode(self, h):
        raise NotImplementedError

    def decode(self, payload, like):
        raise NotImplementedError

    def transfer(self, y, is_sender, is_receiver, link):
        """h̃ on the receiving stage (zeros elsewhere). `link.send(payload)` is the boundary's ppermute (and
        `link.send_back` the reverse one, for a format that encodes its backward message itself)."""
        like = jax.ShapeDtypeStruct(y.shape, y.dtype)
        payload_like = jax.eval_shape(self.encode, like)
        payload = jax.lax.cond(is_sender, self.encode, lambda h: _zeros(payload_like), y)
        recv = link.send(payload)
        return jax.lax.cond(is_receiver, lambda p: self.decode(p, like), lambda p: _zeros(like), recv)

    def payload_like(self, like):
        return jax.eval_shape(self.encode, like)


class DenseWire(Wire):
    """The activation itself (`fast.codec: none`, and stage boundaries the codec does not act on)."""

    def encode(self, h):
        return h

    def decode(self, payload, like):
        return payload

    def transfer(self, y, is_sender, is_receiver, link):  # nothing to encode: no cond needed
        return link.send(y)


class MaskWire(Wire):
    """prf_mask exact-k: the k kept values of each token, in channel order. `keep_fn()` regenerates the mask
    [mb, T, H] (bool, exactly k True per token) from the PRF key; `values_fn(h)` is the emulated codec's output
    (rescaled, zeros where dropped), whose kept entries are what is sent."""

    def __init__(self, keep_fn, values_fn, k: int):
        self.keep_fn, self.values_fn, self.k = keep_fn, values_fn, int(k)

    def _index(self):
        """(keep [mb, T, H], slot [mb, T, H]: a kept channel's place in the payload, channel [mb, T, k]: the
        payload's channels in order). Both are gathers along the channel axis only, which the partitioner keeps
        local to each data shard (a scatter with explicit row indices made it all-gather the microbatch)."""
        keep = self.keep_fn()
        slot = jnp.cumsum(keep.astype(jnp.int32), axis=-1) - 1  # rank of a kept channel among its token's kept ones
        channel = jnp.argsort(~keep, axis=-1, stable=True)[..., : self.k]  # kept channels first, in channel order
        return keep, jnp.clip(slot, 0, self.k - 1), channel

    def encode(self, h):
        _, _, channel = self._index()
        return jnp.take_along_axis(self.values_fn(h), channel, axis=-1)

    def decode(self, payload, like):
        keep, slot, _ = self._index()
        return jnp.where(keep, jnp.take_along_axis(payload, slot, axis=-1), jnp.zeros((), payload.dtype))


class LowRankWire(Wire):
    """Y = h·Q in the activation dtype (the emulated codec's own product), rebuilt as Y·Qᵀ."""

    def __init__(self, Q):
        self.Q = jax.lax.stop_gradient(Q)

    def encode(self, h):
        mb, T, H = h.shape
        return lowrank_reference(h.reshape(mb * T, H), self.Q)[0].reshape(mb, T, -1)

    def decode(self, payload, like):
        mb, T, r = payload.shape
        Qc = self.Q.astype(payload.dtype)
        out = jax.lax.dot_general(
            payload.reshape(mb * T, r), Qc, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )
        return out.astype(like.dtype).reshape(like.shape)
