"""The dense probe and the gradient-fidelity gauge: how far the trainer's codec view is from the dense policy.

Both run every `train.probe_every` GRPO steps and cost extra passes, never a change of state:
- `dense_probe_metrics`: reference KL with codecs off everywhere (`kl/ref_dense`) against the codec view at the same
  point (`kl/ref_codec`), their ratio `kl/gain`, and the dense trainer's own gap to the sampler. Host scalars.
- `make_fidelity_fn`: on one mini-batch, the gradient the fast circuit applies (codec forward/backward, the data-
  parallel reduce or PowerSGD, then the merger) against the gradient of the dense step on the same batch (codecs off,
  dense reference, dense TIS), overall and per parameter group, plus how far each boundary's codec-view activation
  is from the dense one. Cost: one fast forward/backward, one dense forward/backward, three no-grad forwards.

A fast circuit can learn only as far as its gradient points where the dense one does: `fidelity/grad_cos` near 0
means the updates are noise to the dense policy the sampler runs, whatever the codec-view loss says.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

from twocircuit_jax.grpo.loss import kl_penalty
from twocircuit_jax.grpo.tis import correction_weights
from twocircuit_jax.names import path_str
from twocircuit_jax.parallel import mesh as pmesh, micro_batch as accumulate, pipeline as pipe

# Parameter groups of the fidelity gauge, by the first matching path fragment (docs/architecture.md's pytree).
GROUPS = (
    ("embed", "embed"),
    ("lm_head", "lm_head"),
    ("_norm", "norm"),
    ("q_proj", "attn"),
    ("k_proj", "attn"),
    ("v_proj", "attn"),
    ("o_proj", "attn"),
    ("gate_proj", "mlp"),
    ("up_proj", "mlp"),
    ("down_proj", "mlp"),
)


def dense_probe_sums(lp_dense, ref_dense, old_logp, ref_codec, sampler_logp, mask, estimator):
    """[3] fp32: the token means of the dense reference KL, the codec-view reference KL and the dense gap to the
    sampler. One program when jitted (`estimator` static): on sharded inputs, op-by-op evaluation would put several
    small multi-device programs (reductions, reshards) in flight at once, which can deadlock XLA:CPU
    (parallel/dispatch.py)."""
    n = jnp.maximum(jnp.sum(mask), 1.0)
    dense = jnp.sum(kl_penalty(lp_dense, ref_dense, estimator) * mask) / n
    codec = jnp.sum(kl_penalty(old_logp, ref_codec, estimator) * mask) / n
    gap = jnp.sum(jnp.abs(jnp.exp(lp_dense) - jnp.exp(sampler_logp)) * mask) / n
    return jnp.stack([dense, codec, gap]).astype(jnp.float32)


def dense_probe_metrics(lp_dense, ref_dense, old_logp, ref_codec, sampler_logp, mask, estimator, sums=None) -> dict:
    """All inputs [B, T] (mask: every sampled token). Returns host floats; reading them is a host sync. `sums`: the
    jitted `dense_probe_sums` to use (the trainer's, through parallel/dispatch.py); by default it is jitted here."""
    fn = sums if sums is not None else jax.jit(dense_probe_sums, static_argnames="estimator")
    dense, codec, gap = (
        float(x)
        for x in jax.device_get(fn(lp_dense, ref_dense, old_logp, ref_codec, sampler_logp, mask, estimator=estimator))
    )
    gain = codec / dense if dense > 1e-8 else float("nan")  # undefined before the policy has moved
    return {"kl/ref_dense": dense, "kl/ref_codec": codec, "kl/gain": gain, "probe/prob_gap_mean": gap}


def group_of(path: str) -> str:
    for frag, group in GROUPS:
        if frag in path:
            return group
    return "other"


def _flat(tree) -> dict:
    out = {}
    for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out[path_str(p)] = x.astype(jnp.float32)
    return out


def grad_cosines(applied, dense, prefix: str = "fidelity/grad_cos") -> dict:
    """cos(applied, dense) overall and per group; groups whose dense gradient is 0 are left out (NaN)."""
    a, d = _flat(applied), _flat(dense)
    dots, na, nd = {}, {}, {}
    for k in d:
        g = group_of(k)
        dots[g] = dots.get(g, 0.0) + jnp.sum(a[k] * d[k])
        na[g] = na.get(g, 0.0) + jnp.sum(a[k] * a[k])
        nd[g] = nd.get(g, 0.0) + jnp.sum(d[k] * d[k])
    cos = lambda x, y, z: jnp.where((y > 0) & (z > 0), x / jnp.sqrt(jnp.maximum(y * z, 1e-38)), jnp.nan)  # noqa
    out = {f"{prefix}/{g}": cos(dots[g], na[g], nd[g]) for g in dots}
    out[prefix] = cos(sum(dots.values()), sum(na.values()), sum(nd.values()))
    return out


def make_fidelity_fn(
    model_cfg,
    grpo_cfg,
    max_new_tokens: int,
    codec,
    compute: Callable,
    grad_transform: Optional[Callable],
    make_dense_loss: Callable,
    pipeline=None,
    *,
    micro_batch: int = 0,
    mesh=None,
):
    """fn(params, ref_params, batch, cs) -> {fidelity/*: scalar}; `cs` is the circuit state; `pipeline` the staged
    forward (mesh.stage > 1, parallel/pipeline.py) or None. `micro_batch` (train.micro_batch_per_device; `mesh` gives the
    replica count and keeps the batch sharding): the dense gradient is accumulated and the no-grad passes run over
    micro-batches of that many rows per replica, like the train step; `compute` is the step's own (accumulating)
    gradient.

    `compute(params, batch, cs) -> (grads, loss, metrics, aux, cs)` is the train step's own gradient (the circuit's
    grad_fn, PowerSGD included); `grad_transform` the merger (None without the anchor); `make_dense_loss()` the
    dense GRPO loss (codec None). The batch must be the step's first mini-batch at the weights the tick will update (ratio one,
    so the fast and dense objectives differ only by the view). Error memories and merger states are discarded.
    """
    dense_loss = make_dense_loss()
    dp = pmesh.dp_size(mesh) if mesh is not None else 1
    dense_grad = accumulate.value_and_grad(dense_loss, micro_batch, dp=dp, mesh=mesh)

    def by_rows(fn, batch):
        """fn(rows) -> per-row array, over micro-batches; rows back in batch order."""
        out, k = accumulate.map_rows(fn, batch, micro_batch, dp=dp, mesh=mesh)
        return out if k == 1 else pipe.join_rows(out)

    def dense_logp(p, batch):
        def one(rows):
            stats, _ = pipe.forward(model_cfg, p, rows["tokens"], rows["attention_mask"], pipeline=pipeline)
            return jax.lax.stop_gradient(stats.logp)

        return by_rows(one, {k: batch[k] for k in ("tokens", "attention_mask")})

    def boundary_states(p, batch, boundary_fn):
        """{boundary: [B, T, H]} what each boundary's receiver rebuilds in one forward (rows in batch order)."""
        _, aux = pipe.forward(
            model_cfg,
            p,
            batch["tokens"],
            batch["attention_mask"],
            pipeline=pipeline,
            rows={"sample_id": batch["sample_id"]},
            boundary_fn=boundary_fn,
            reduce=False,
        )
        return aux if pipeline is None else {b: pipe.join_rows(h) for b, h in aux.items()}

    def boundary_errors(params, batch, cs):
        if codec is None or not codec.applies("train"):
            return {}
        codec_fn = codec.boundary_fn(cs.codec, "train", cs.clock.step)

        def seen(mb):  # the codec view: the receiver's rebuilt activation, as the aux
            hook, layers, wires = codec_fn(mb)
            return (lambda layer, h: (hook(layer, h)[0],) * 2), layers, wires

        def dense(mb):
            return (lambda layer, h: (h, h)), codec_fn(mb)[1], {}

        p = jax.lax.stop_gradient(params)

        def sums(rows):  # {boundary: [2] (Σ‖h̃ − h‖², Σ‖h‖²) over real tokens}: sums add up over micro-batches
            codec_h, dense_h = boundary_states(p, rows, seen), boundary_states(p, rows, dense)
            w = rows["attention_mask"].astype(jnp.float32)[..., None]
            out = {}
            for b in sorted(codec_h):
                d = (codec_h[b].astype(jnp.float32) - dense_h[b].astype(jnp.float32)) * w
                ref = dense_h[b].astype(jnp.float32) * w
                out[b] = jnp.stack([jnp.sum(d * d), jnp.sum(ref * ref)])
            return out

        rows = {k: batch[k] for k in ("tokens", "attention_mask", "sample_id")}
        out, k = accumulate.map_rows(sums, rows, micro_batch, dp=dp, mesh=mesh)
        if k > 1:
            out = jax.tree.map(lambda x: jnp.sum(x, axis=0), out)
        return {
            f"fidelity/boundary_rel_err/{b}": jnp.sqrt(s[0] / jnp.maximum(s[1], 1e-30)) for b, s in sorted(out.items())
        }

    def fn(params, ref_params, batch, cs):
        cs = cs._replace(clock=cs.clock._replace(first_minibatch=jnp.asarray(True)))
        g_pre = compute(params, batch, cs)[0]
        g_post = grad_transform(g_pre, cs)[0] if grad_transform is not None else g_pre
        # The dense step on this batch: ratio one, dense reference, TIS weights dense vs sampler.
        lp = dense_logp(params, batch)
        dense_batch = dict(batch, old_logp=lp)
        if "ref_logp" in batch:
            dense_batch["ref_logp"] = dense_logp(ref_params, batch)
        if "is_weight" in batch:
            dense_batch["is_weight"] = correction_weights(lp, batch["sampler_logp"], batch["response_mask"], grpo_cfg)[
                0
            ]
        g_dense = dense_grad(params, dense_batch, cs)[1]
        out = grad_cosines(g_post, g_dense)
        # Without the anchor nothing rewrites G and the two are equal; logged anyway so runs compare key for key.
        out["fidelity/grad_cos_pre_merger"] = grad_cosines(g_pre, g_dense, "c")["c"]
        norm = lambda t: jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(t)))  # noqa
        out["fidelity/grad_norm_ratio"] = norm(g_post) / jnp.maximum(norm(g_dense), 1e-30)
        out.update(boundary_errors(params, batch, cs))
        return out

    return fn
