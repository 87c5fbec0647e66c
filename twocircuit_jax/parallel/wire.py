"""What crosses a real stage boundary (parallel/pipeline.py): each codec's packed payload, not a masked dense tensor.
This module holds the protocol and the dense format; each codec's own format lives in its codec's file
(fast/codecs/), and the pipeline only ever calls `transfer`.

A `Wire` is one boundary's format for one microbatch: `encode(h [mb, T, H]) -> payload` at the sending stage,
`decode(payload) -> h̃` at the receiving one, with decode(encode(h)) equal, bit for bit, to the codec's emulated
hook (the one-program path of fast/codecs). `transfer` runs encode on the sender only, moves the payload with the
pipeline's `ppermute`, and decodes on the receiver only (the other stages skip both under `lax.cond`).

The backward message is the cotangent of the payload, moved by the transposed `ppermute`: for the linear formats
(dense, the PRF mask, the low-rank coefficients) autodiff already makes it the same size as the forward one, k
values or r coefficients per token, and equal to the emulated path's gradient. A format whose backward must be
encoded on its own (stochastic rounding draws fresh bits for the gradient) overrides `transfer` with a custom VJP.

Formats (per token and boundary): dense, H values (here); prf_mask, lowrank, sr_quant: their codec's `wire`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def zeros_like(like):
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
        payload = jax.lax.cond(is_sender, self.encode, lambda h: zeros_like(payload_like), y)
        recv = link.send(payload)
        return jax.lax.cond(is_receiver, lambda p: self.decode(p, like), lambda p: zeros_like(like), recv)

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
