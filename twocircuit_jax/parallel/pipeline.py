"""Real pipeline stages (mesh axis `stage`): a GPipe forward whose boundary messages cross devices with `ppermute`.

The layer stack [L, ...] is split over `stage` in S equal contiguous parts (parallel/mesh.py PARAM_RULES), so each
stage's devices hold L/S layers. The batch is cut into M microbatches (`train.pipeline_microbatches`). Under `shard_map`
(manual over `stage` only; `data`/`fsdp`/`tensor` stay with XLA's partitioner) the schedule runs M + S - 1 ticks:
at tick i stage s runs its layers on microbatch i - s, then every stage boundary k (between stages k and k+1)
moves its message with one `ppermute` from k to k+1. The backward pass is autodiff of that loop: each forward
`ppermute` transposes into one from k+1 to k, carrying the cotangent of the message, in reverse tick order (GPipe:
all forwards, then all backwards). The idle fraction of a stage is the bubble, (S - 1) / (M + S - 1).

What crosses boundary k is decided by the caller through `boundary_fn(mb)` (the fast circuit, the anchor's sketch,
the probe), built per microbatch from its rows (attention mask, positions, sample ids):
  hook(layer, h) -> (_, aux)     an observer at the sender: only `aux` is kept (the codec's metrics, a sketch);
                                 its h output is ignored, since what the receiver gets is the wire's
  wires {layer: Wire}            how a boundary's message is encoded and decoded (fast/wire.py); a stage boundary
                                 without one sends the dense activation
The ends are stage-local too: the first stage embeds microbatch i at tick i, and the last stage applies the final
norm and LM head to each microbatch as it leaves, reducing the logits at once to what the loss reads (`TokenStats`:
the token log-probs and entropies, [B, T] each). Only those two scalars per token (and the boundary aux) are summed
over `stage` at the exit; logits and hidden states never leave the last stage. The embedding, final norm and head
weights are replicated over `stage` (sharded over `fsdp`/`tensor` like the rest): the last stage reads them, the
first stage reads the embedding, and their gradients are summed over `stage` once per backward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from twocircuit_jax.boundaries import boundary_layers
from twocircuit_jax.config.base import registered
from twocircuit_jax.config.sections import ActivationCodecConfig
from twocircuit_jax.model import qwen2
from twocircuit_jax.model.head import TokenStats, chunks_logits, head_stats  # TokenStats: read from here by the passes
from twocircuit_jax.model.qwen2 import dtype_of
from twocircuit_jax.names import key_name
from twocircuit_jax.parallel.wire import DenseWire

AXIS = "stage"
DATA = "data"  # the replica axis the pipeline handles by hand (parallel/mesh.py)
# Named scopes of the pipeline's collectives, read back from the compiled program by fast/bytes.py (a backward
# message is the transpose of a forward one: its op name carries "transpose(").
BOUNDARY, STAGE_EXIT = "stage_boundary", "stage_exit"


class Link:
    """Boundary k's two directions: `send` stage k -> k + 1, `send_back` k + 1 -> k (every data replica's pair at
    once). Autodiff transposes `send` into a reverse send by itself; `send_back` is for a wire format whose backward
    message is encoded on its own (fast/wire.py SrQuantWire)."""

    def __init__(self, k: int):
        self.k = k

    def send(self, payload):
        with jax.named_scope(BOUNDARY):
            return jax.lax.ppermute(payload, AXIS, [(self.k, self.k + 1)])

    def send_back(self, payload):
        with jax.named_scope(BOUNDARY + "_back"):
            return jax.lax.ppermute(payload, AXIS, [(self.k + 1, self.k)])


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Share of stage-ticks that hold no microbatch in the GPipe schedule (forward and backward alike)."""
    return (stages - 1) / (microbatches + stages - 1)


def split_rows(x, m: int):
    """[B, ...] -> [M, B/M, ...], microbatch j = rows j, j+M, j+2M, ... (every data shard's contiguous block of rows
    holds an equal part of each microbatch, so the split moves no data between replicas)."""
    return x.reshape((x.shape[0] // m, m) + x.shape[1:]).swapaxes(0, 1)


def join_rows(x):
    """Inverse of `split_rows`: [M, B/M, ...] -> [B, ...]."""
    return x.swapaxes(0, 1).reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


class Pipeline:
    """The staged forward of one model on one mesh: `forward(params, tokens, attention_mask, rows, boundary_fn)`."""

    def __init__(self, model_cfg, mesh, microbatches: int):
        self.cfg, self.mesh = model_cfg, mesh
        self.stages = int(mesh.shape[AXIS])
        L = model_cfg.num_layers
        if L % self.stages:
            raise ValueError(f"mesh.stage={self.stages} must divide model.num_layers={L} (equal stages)")
        self.microbatches = int(microbatches) or self.stages
        self.per_stage = L // self.stages
        self.boundaries = boundary_layers(L, self.stages)  # stage k ends at layer boundaries[k]

    @property
    def bubble(self) -> float:
        return bubble_fraction(self.stages, self.microbatches)

    def check_batch(self, rows: int, dp: int):
        m = self.microbatches
        if rows % m or (rows // m) % dp:
            raise ValueError(
                f"train.pipeline_microbatches={m}: a forward's {rows} rows must split into {m} microbatches whose size "
                f"divides over the {dp} data-parallel replicas"
            )

    def forward(self, params, tokens, attention_mask, rows=None, boundary_fn=None, entropy_grad=False, row_aux=False):
        """(TokenStats [B, T] each, {hooked layer: aux with a leading [M] microbatch axis}).

        rows: extra per-row arrays [B, ...] the boundary functions read (sample ids), split with the batch.
        boundary_fn(mb) -> (hook or None, hook_layers, {layer: Wire}); mb holds the microbatch's rows plus
        `tokens`, `attention_mask` and `positions`. Hooked layers and wired layers must be stage boundaries.
        row_aux: the hooks' aux is per row ([rows of the microbatch, ...]: kept whole); otherwise it is a summary of
        the microbatch, summed (sketches, token counts) or averaged (the rest) over the data replicas."""
        cfg, M, S = self.cfg, self.microbatches, self.stages
        B, T = tokens.shape
        context = jax.sharding.get_abstract_mesh()
        data_manual = context.empty or DATA not in context.manual_axes
        replicas = self.mesh.shape[DATA] if data_manual else 1
        self.check_batch(B, replicas)
        rows = dict(rows or {})
        rows["tokens"] = tokens
        rows["attention_mask"] = attention_mask
        rows["positions"] = qwen2.default_positions(attention_mask)
        rows_mb = jax.tree.map(lambda a: split_rows(a, M), rows)
        ends = {k: v for k, v in params.items() if k != "layers"}  # embedding, final norm, head
        act_dtype = dtype_of(cfg.compute_dtype)
        # XLA:CPU aborts on a bf16 all-reduce inside a partially manual shard_map ("Invalid binary instruction
        # opcode copy"): the end weights, whose gradients are summed over `stage`, enter in fp32 there and are cast
        # back inside (lossless both ways, so the values are those of the bf16 weights).
        narrow = {k: v.dtype for k, v in ends.items()}
        if jax.default_backend() == "cpu":
            ends = {k: v.astype(jnp.float32) if v.dtype == jnp.bfloat16 else v for k, v in ends.items()}
        mb_rows = B // M // replicas  # a replica's rows of one microbatch
        # One call on the first microbatch, traced only for what it declares: the hooked and wired layers.
        first = boundary_fn(jax.tree.map(lambda a: a[0, :mb_rows], rows_mb)) if boundary_fn else (None, (), {})
        hook_layers, wired = tuple(first[1]), dict(first[2])
        bad = (set(hook_layers) | set(wired)) - set(self.boundaries)
        if bad:
            raise ValueError(f"pipeline: layers {sorted(bad)} are not stage boundaries {self.boundaries}")
        h_like = jax.ShapeDtypeStruct((mb_rows, T, cfg.hidden_size), act_dtype)
        # The aux shapes, for the zeros that stages without the boundary (and bubble ticks) contribute.
        aux_like = {}
        if first[0] is not None and hook_layers:
            for b in hook_layers:
                aux_like[b] = jax.eval_shape(lambda h, b=b: first[0](b, h)[1], h_like)

        def pick(tree, j):
            return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, jnp.clip(j, 0, M - 1), keepdims=False), tree)

        def body_fn(layers, ends, rows_mb):
            s = jax.lax.axis_index(AXIS)
            ends = {k: v.astype(narrow[k]) for k, v in ends.items()}

            def stage_layers(h, mb):  # this stage's slice of the stack: the model's layer stack helper
                cos, sin, mask = qwen2.layer_inputs(cfg, mb["attention_mask"], mb["positions"])
                return qwen2.run_layers(cfg, layers, h, cos, sin, mask)[0]

            stats_zero = TokenStats(*(jnp.zeros((mb_rows, T), jnp.float32) for _ in range(2)))

            # The last stage: the logits reduced at once to two scalars per token, `model.logits_chunk` positions
            # at a time (model/head.py), on the ticks where a microbatch leaves it.
            def head(done, y, tok):
                def run(y, tok):
                    return jax.lax.cond(
                        done,
                        lambda y, tok: head_stats(cfg, ends, y, tok, entropy_grad),
                        lambda y, tok: stats_zero,
                        y,
                        tok,
                    )

                if not chunks_logits(cfg, T):
                    return run(y, tok)
                # A checkpointed chunk inside a `cond` inside the tick scan makes autodiff stack the head weight as a
                # residual of every tick ([M + S - 1, V, H]: 11 x 0.93 GB at Qwen2.5-1.5B, stage 8, 4 microbatches);
                # checkpointing the cond keeps only y and the tokens per tick (the weight stays loop-invariant). The
                # backward's re-run of the cond is pruned to what the chunks' own recomputation needs.
                return jax.checkpoint(run, prevent_cse=False)(y, tok)

            def tick(carry, i):
                state, outs, auxes = carry
                # Only the first stage embeds (a per-device branch: the other stages skip the lookup).
                inp = jax.lax.cond(
                    s == 0, lambda st: qwen2.embed_tokens(cfg, ends, pick(rows_mb["tokens"], i)), lambda st: st, state
                )
                y = stage_layers(inp, pick(rows_mb, i - s))
                new_state = jnp.zeros_like(y)
                for k, b in enumerate(self.boundaries):
                    m = i - k  # the microbatch crossing boundary k at this tick (sender k, receiver k + 1)
                    hook, _, wires = boundary_fn(pick(rows_mb, m)) if boundary_fn else (None, (), {})
                    wire = wires.get(b, DenseWire())
                    recv = wire.transfer(y, s == k, s == k + 1, Link(k))
                    new_state = jnp.where(s == k + 1, recv, new_state)
                    if b in aux_like:
                        zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), aux_like[b])
                        a = jax.lax.cond(s == k, lambda h: hook(b, jax.lax.stop_gradient(h))[1], lambda h: zeros, y)
                        ok = (m >= 0) & (m < M)
                        auxes[b] = jax.tree.map(
                            lambda buf, v: jnp.where(
                                ok, jax.lax.dynamic_update_index_in_dim(buf, v, jnp.clip(m, 0, M - 1), 0), buf
                            ),
                            auxes[b],
                            a,
                        )
                m_last = i - (S - 1)
                done = (s == S - 1) & (m_last >= 0)
                st = head(done, y, pick(rows_mb["tokens"], m_last))
                outs = jax.tree.map(
                    lambda buf, v: jnp.where(
                        done, jax.lax.dynamic_update_index_in_dim(buf, v, jnp.clip(m_last, 0, M - 1), 0), buf
                    ),
                    outs,
                    st,
                )
                return (new_state, outs, auxes), None

            auxes = {b: jax.tree.map(lambda a: jnp.zeros((M,) + a.shape, a.dtype), al) for b, al in aux_like.items()}
            outs = jax.tree.map(lambda a: jnp.zeros((M,) + a.shape, a.dtype), stats_zero)
            init = (jnp.zeros(h_like.shape, act_dtype), outs, auxes)
            (_, outs, auxes), _ = jax.lax.scan(tick, init, jnp.arange(M + S - 1))
            # Only the last stage's `outs` (and the sender's aux) are non-zero: the sum over stages is a broadcast
            # of two fp32 scalars per token.
            with jax.named_scope(STAGE_EXIT):
                outs, auxes = jax.lax.psum(outs, AXIS), jax.lax.psum(auxes, AXIS)
            if data_manual and not row_aux:
                summed = summed_aux_keys()
                auxes = jax.tree_util.tree_map_with_path(
                    lambda p, a: jax.lax.psum(a, DATA) if key_name(p[-1]) in summed else jax.lax.pmean(a, DATA),
                    auxes,
                )
            return outs, auxes

        layer_specs = jax.tree.map(lambda _: P(AXIS), params["layers"])
        # Manual over `data` too: each replica runs its rows of every microbatch and accumulates its own gradient,
        # which the shard_map's transpose sums over `data` once per backward. Left to the partitioner, the tick
        # loop's gradient carry (replicated over `data`) is all-reduced at every tick, and the first stage's
        # embedding scatter all-gathers the batch. Inside another shard_map (a gradient codec's, already manual over
        # the batch axes) the pipeline nests in its context mesh, manual over `stage` only.
        rows_spec = P(None, DATA) if data_manual else P()
        staged = jax.shard_map(
            body_fn,
            mesh=self.mesh if context.empty else context,
            in_specs=(layer_specs, P(), rows_spec),
            out_specs=(rows_spec, rows_spec if row_aux else P()),
            axis_names={AXIS, DATA} if data_manual else {AXIS},
            check_vma=False,
        )
        stats, aux = staged(params["layers"], ends, rows_mb)
        return TokenStats(*(join_rows(a) for a in stats)), aux


def summed_aux_keys() -> frozenset:
    """The codec aux leaves that add up over rows (microbatches, replicas): what each registered codec's section
    declares (`summed_aux`, the low-rank sketch and its token count); the others (ratios, errors) average."""
    return frozenset(k for section in registered(ActivationCodecConfig).values() for k in section.summed_aux)


def reduce_aux(aux: dict) -> dict:
    """{layer: aux [M, ...]} -> {layer: aux}: sketches and token counts summed over microbatches, the rest averaged."""
    summed = summed_aux_keys()
    return jax.tree_util.tree_map_with_path(
        lambda p, a: jnp.sum(a, axis=0) if key_name(p[-1]) in summed else jnp.mean(a, axis=0), aux
    )


def forward(
    model_cfg,
    params,
    tokens,
    attention_mask,
    *,
    pipeline=None,
    rows=None,
    boundary_fn=None,
    reduce=True,
    entropy_grad=False,
):
    """The policy forward every pass of the trainer uses: (TokenStats [B, T] each, {boundary layer: aux}).

    Without a pipeline (mesh.stage = 1) this is `qwen2.decoder_with_aux` with the hook `boundary_fn` builds for the
    whole batch (a codec acts in place: the emulated path), and the stats of its logits (model/head.py, chunked
    over the sequence by `model.logits_chunk`). With one, the staged forward above; aux is reduced over
    microbatches (`reduce=False`: kept per microbatch, [M, ...], rows in `split_rows` order). `entropy_grad`: whether the entropy carries a gradient (an entropy bonus); without it the
    backward skips the entropy's share of the head."""
    if pipeline is None:
        mb = dict(rows or {}, tokens=tokens, attention_mask=attention_mask)
        mb["positions"] = qwen2.default_positions(attention_mask)
        hook, layers, _ = boundary_fn(mb) if boundary_fn is not None else (None, (), {})
        h, aux = qwen2.decoder_with_aux(model_cfg, params, tokens, attention_mask, hook=hook, hook_layers=layers)
        return head_stats(model_cfg, params, h, tokens, entropy_grad), aux
    stats, aux = pipeline.forward(params, tokens, attention_mask, rows, boundary_fn, entropy_grad, row_aux=not reduce)
    return stats, (reduce_aux(aux) if reduce else aux)
