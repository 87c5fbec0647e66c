"""The fast circuit as the GRPO loop sees it (design §2, §3): one object that owns the codec choice.

It holds configuration and host counters only; its array state lives in the circuit state the loop threads through
the step (train/circuit_state.py): `cs.codec` (the activation codec's state: the low-rank basis, or None) and
`cs.grad` (PowerSGD's state, or None). Contract with train/loop.py and train/grpo_step.py:
  init_codec_state() / init_grad_state(params_like)    the two fields, placed on the mesh
  applies(tag) / hook(codec_state, tag, step, sample_ids, positions, attention_mask) -> (hook_fn, hook_layers)
                                    traced inside jit; `step` is gs (the PRF step key), never the tick
  summarize(aux_by_layer)           scalar codec metrics inside the jitted loss
  absorb_aux(codec_state, aux)      traced inside the step: folds the train forward's sketch into the basis
  grad_fn(param_shardings)          None (XLA's implicit dp mean) or the PowerSGD shard_map factory
  tick_done()                       host, after each tick (counters)
  end_step(codec_state, gs, grad_state)   host, after the last tick: refresh/activate the basis, bytes, counters
The basis changes only in end_step (or `activate_basis`, which refuses to run mid-step), so no forward inside a
step sees a new basis (design §2 step 5).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from twocircuit_jax.config.base import ConfigError
from twocircuit_jax.fast import bytes as fbytes, lowrank as lr, powersgd as psgd
from twocircuit_jax.fast.boundaries import boundary_layers
from twocircuit_jax.fast.mask import make_mask_hook
from twocircuit_jax.fast.sr_quant import make_quant_hook
from twocircuit_jax.parallel import dispatch
from twocircuit_jax.parallel.mesh import BATCH_AXES, dp_size

TRAIN, OLD, REF, DENSE = "train", "old_logprob", "ref_logprob", "dense"
CODECS = ("none", "prf_mask", "lowrank", "sr_quant")
GRAD_CODECS = ("none", "powersgd")


def _rel_err(h, out, attention_mask):
    """‖h − h̃‖_F / ‖h‖_F over real tokens, fp32, outside the gradient path (metric only)."""
    h32 = jax.lax.stop_gradient(h).astype(jnp.float32)
    d = jax.lax.stop_gradient(out).astype(jnp.float32) - h32
    w = jnp.asarray(attention_mask, jnp.float32)[..., None]
    return jnp.sqrt(jnp.sum(d * d * w) / jnp.maximum(jnp.sum(h32 * h32 * w), 1e-30))


class FastCircuit:
    def __init__(self, run_cfg, model_cfg, mesh):
        f = run_cfg.fast
        self.run_cfg, self.fcfg, self.model_cfg, self.mesh = run_cfg, f, model_cfg, mesh
        if f.codec not in CODECS:
            raise ConfigError("fast.codec", f"got {f.codec!r}; allowed {', '.join(CODECS)}")
        if f.grad_codec not in GRAD_CODECS:
            raise ConfigError("fast.grad_codec", f"got {f.grad_codec!r}; allowed {', '.join(GRAD_CODECS)}")
        try:
            self.boundaries = boundary_layers(model_cfg.num_layers, f.pp_size)
        except ValueError as e:
            raise ConfigError("fast.pp_size", str(e)) from None
        self.has_activation_codec = f.codec != "none"
        self.owns_basis = f.codec == "lowrank" and not run_cfg.anchor_owns_q
        self.interpret = bool(f.kernel_interpret)
        self._check_kernel()
        if f.codec == "lowrank" and not f.rank < model_cfg.hidden_size:
            raise ConfigError("fast.rank", f"got {f.rank}; must be below model.hidden_size={model_cfg.hidden_size}")
        self.dp = dp_size(mesh)
        if f.grad_codec == "powersgd" and (mesh.shape["fsdp"] != 1 or mesh.shape["tensor"] != 1):
            raise ConfigError(
                "fast.grad_codec",
                "powersgd needs replicated parameters: set mesh.fsdp=1 and "
                f"mesh.tensor=1 (got fsdp={mesh.shape['fsdp']}, "
                f"tensor={mesh.shape['tensor']})",
            )
        t = run_cfg.train
        # Tokens one replica sends per tick across a boundary: its share of the mini-batch's padded [B, T] (what a
        # pipeline link would carry), so activation and gradient bytes are both per replica. Train forwards per
        # step: ticks_per_step * ppo_epochs (design §3.6: the gradient-bearing forward only).
        self.tokens_per_tick = (
            t.mini_batch * run_cfg.sampler.n * (t.max_prompt_len + run_cfg.sampler.sampling.max_new_tokens)
        )
        self.ticks_per_step = run_cfg.ticks_per_step * t.ppo_epochs
        self.applications = {TRAIN: 0, OLD: 0, REF: 0}  # host counters: codec forwards executed, per tag
        self.steps = 0  # host counter: end_step calls
        self._mid_step = False
        self._params_like = None
        self._bootstrap_jit = self._absorb_jit = None

    def _check_kernel(self):
        f = self.fcfg
        if not f.use_kernel:
            return
        if f.codec == "sr_quant":
            raise ConfigError("fast.use_kernel", "sr_quant has no Pallas kernel; set fast.use_kernel=false")
        if f.codec == "none" and f.grad_codec == "none":
            raise ConfigError("fast.use_kernel", "no codec is on, so there is no kernel to use")
        if jax.default_backend() == "cpu" and not self.interpret:
            raise ConfigError(
                "fast.use_kernel",
                "the Pallas kernels cannot be compiled on the CPU backend; set "
                "fast.use_kernel=false (jnp reference) or fast.kernel_interpret=true "
                "(interpret mode, tests only); there is no silent fallback",
            )

    # --- state ------------------------------------------------------------------------------------------------
    def init_codec_state(self):
        """The activation codec's state, replicated: a LowRankState for lowrank, None for the stateless codecs."""
        if self.fcfg.codec != "lowrank":
            return None
        low = lr.init_lowrank(self.fcfg, self.model_cfg.hidden_size, self.boundaries)
        return jax.device_put(low, NamedSharding(self.mesh, P()))

    def init_grad_state(self, params_like=None):
        """PowerSGD's state (Q replicated, the per-replica error memory split over dp), or None."""
        if params_like is not None:
            self._params_like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params_like)
        if self.fcfg.grad_codec != "powersgd":
            return None
        like = params_like if params_like is not None else self._params_shapes()
        g = psgd.init_powersgd(self.fcfg, like, self.dp)
        return jax.device_put(g, self.grad_state_shardings(g))

    def grad_state_shardings(self, grad_state):
        if grad_state is None:
            return None
        specs = psgd.state_specs(grad_state, BATCH_AXES)
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs, is_leaf=lambda x: isinstance(x, P))

    def _params_shapes(self):
        from twocircuit_jax.model.qwen2 import init_params  # shapes only: eval_shape allocates nothing

        return jax.eval_shape(lambda: init_params(self.model_cfg, jax.random.key(0)))

    # --- the boundary hook ------------------------------------------------------------------------------------
    def applies(self, tag: str) -> bool:
        if tag == DENSE:
            return False
        if tag not in (TRAIN, OLD, REF):
            raise ValueError(f"unknown forward tag {tag!r}; allowed {TRAIN}, {OLD}, {REF}, {DENSE}")
        if not self.has_activation_codec:
            return False
        return {TRAIN: True, OLD: self.fcfg.codec_old_logprob, REF: self.fcfg.codec_reference}[tag]

    def hook(self, codec_state, tag, step, sample_ids, positions, attention_mask):
        """(hook_fn, hook_layers) for one forward. A dense-path tag is a hard error (design §3.1)."""
        if tag == DENSE or not self.applies(tag):
            raise ValueError(
                f"fast circuit: no codec may act on the {tag!r} path (fast.codec={self.fcfg.codec}, "
                f"codec_old_logprob={self.fcfg.codec_old_logprob}, "
                f"codec_reference={self.fcfg.codec_reference})"
            )
        f, b = self.fcfg, self.boundaries
        if f.codec == "lowrank":
            fn = lr.make_lowrank_hook(
                codec_state,
                b,
                sketch=(tag == TRAIN and self.owns_basis),
                attention_mask=attention_mask,
                cfg=f,
                interpret=self.interpret,
                mesh=self.mesh,
            )
            return fn, b
        if f.codec == "prf_mask":
            inner = make_mask_hook(
                f, b, step, sample_ids, positions, attention_mask, interpret=self.interpret, mesh=self.mesh
            )
        else:
            inner = make_quant_hook(f, b, step, sample_ids, positions, attention_mask)

        def fn(layer, h):
            out, aux = inner(layer, h)
            aux = dict(aux)
            aux["recon_rel_err"] = (
                aux.pop("quant_rel_err", None) if "quant_rel_err" in aux else _rel_err(h, out, attention_mask)
            )
            return out, aux

        return fn, b

    def basis_sketcher(self, basis_state, attention_mask):
        """A dense pass that only sketches: activations pass unchanged, the aux carries the sketch Mᵀ(M·Q_start)
        per boundary (`absorb_sketch` folds it into the basis). The anchor's fire takes it from the loop."""
        inner = lr.make_lowrank_hook(
            basis_state, self.boundaries, sketch=True, attention_mask=attention_mask, encode=False
        )

        def fn(layer, h):  # the sketch only: the codec's error would cost a projection that nobody reads here
            h, aux = inner(layer, h)
            return h, {"sketch": aux["sketch"], "tokens": aux["tokens"]}

        return fn, self.boundaries

    def absorb_sketch(self, codec_state, sketch):
        """Fold a dense pass's sketch (summed over the global batch) into the basis: one power-iteration step,
        staged; `activate` publishes it after the step's last tick. One small jitted program."""
        if self._absorb_jit is None:
            self._absorb_jit = dispatch.jit(
                lambda low, aux: lr.refresh_basis(lr.accumulate_sketch(low, aux), self.fcfg, axis_name=None)
            )
        return self._absorb_jit(codec_state, sketch)

    def bootstrap(self, codec_state, params, batch):
        """`fast.bootstrap` with the low-rank codec (either owner): before the first compressed forward, one discarded
        dense no-grad pass over the first batch sketches against Q0, and one power-iteration step publishes Q1,
        active at once (no codec forward has run yet, so no step sees two bases). Returns (state, metrics)."""
        if not (self.fcfg.codec == "lowrank" and self.fcfg.bootstrap):
            return codec_state, {}
        if self._mid_step:
            raise RuntimeError("lowrank bootstrap must run before the first compressed forward of the run")
        if self._bootstrap_jit is None:
            from twocircuit_jax.model.qwen2 import forward_with_aux

            def sketch(params, batch, st):
                hook, layers = self.basis_sketcher(st, batch["attention_mask"])
                _, aux = forward_with_aux(
                    self.model_cfg,
                    jax.lax.stop_gradient(params),
                    batch["tokens"],
                    batch["attention_mask"],
                    hook=hook,
                    hook_layers=layers,
                )
                return aux

            self._bootstrap_jit = dispatch.jit(sketch)
        aux = self._bootstrap_jit(params, batch, codec_state)  # cost: one dense forward, no backward
        low = lr.accumulate_sketch(codec_state, aux)
        return lr.activate_staged(lr.refresh_basis(low, self.fcfg, axis_name=None)), {"codec/bootstrapped": 1}

    # --- metrics ----------------------------------------------------------------------------------------------
    def summarize(self, aux_by_layer) -> dict:
        """Scalars only (inside the jitted loss): mean and per-boundary mask ratio / reconstruction error."""
        out = {}
        for key in ("mask_ratio", "recon_rel_err"):
            vals = {b: a[key] for b, a in sorted(aux_by_layer.items()) if key in a}
            if vals:
                out[f"codec/{key}"] = jnp.mean(jnp.stack([jnp.asarray(v, jnp.float32) for v in vals.values()]))
                out.update({f"codec/{key}/{b}": jnp.asarray(v, jnp.float32) for b, v in vals.items()})
        return out

    def summarize_aux(self, aux_by_layer, tag: str) -> dict:
        """Host, after the old-log-prob (or reference) pass; marks the step as started."""
        self._mid_step = True
        if not aux_by_layer:
            return {}
        self.applications[tag] = self.applications.get(tag, 0) + 1
        m = self.summarize(aux_by_layer)
        return {f"codec/{tag}/{k[len('codec/') :]}": float(v) for k, v in m.items() if k.count("/") == 1}

    # --- per tick and per step --------------------------------------------------------------------------------
    def absorb_aux(self, codec_state, aux):
        """Traced inside the train step: a fast-owned basis adds the train forward's sketch (summed over the global
        batch) to its running V; every other codec state passes through."""
        if not self.owns_basis:
            return codec_state
        return lr.accumulate_sketch(codec_state, aux)

    def tick_done(self):
        """Host, after each tick: one more train-path codec forward ran; the step has started."""
        self._mid_step = True
        if self.has_activation_codec:
            self.applications[TRAIN] += 1

    def stage_basis(self, codec_state, Q_new: dict):
        """Stage a new basis (anchor-owned case); it becomes active in end_step only."""
        return lr.stage(codec_state, Q_new)

    def activate_basis(self, codec_state):
        """Staged -> active. Refuses inside a step: every forward of a step must see the same basis."""
        if self._mid_step:
            raise RuntimeError(
                "lowrank: a staged basis may become active only after the step's last mini-batch "
                "(design §2 step 5); call end_step"
            )
        return lr.activate_staged(codec_state)

    def end_step(self, codec_state, gs: int, grad_state=None):
        """Host, after the step's last tick: (codec_state', metrics). Refreshes a fast-owned basis when due and
        activates a staged one; reports the basis health, counters and the step's logical bytes."""
        metrics = {}
        if self.fcfg.codec == "lowrank":
            if self.owns_basis and lr.refresh_due(self.fcfg, gs):
                # The sketch already is the sum over dp: it was contracted over the global batch inside jit
                # (or psum-ed in the PowerSGD shard_map), so no axis_name here.
                codec_state = lr.refresh_basis(codec_state, self.fcfg, axis_name=None)
            self._mid_step = False
            codec_state = self.activate_basis(codec_state)
            m = lr.lowrank_metrics(codec_state)
            metrics.update({k: float(v) for k, v in m.items()})
            for b in self.boundaries:
                metrics[f"codec/basis_cond/{b}"] = float(lr.basis_cond(codec_state.Q[b]))
        self._mid_step = False
        self.steps += 1
        metrics["codec/steps"] = self.steps
        metrics.update({f"codec/applications/{k}": v for k, v in self.applications.items()})
        metrics.update(self.step_bytes(grad_state))
        return codec_state, metrics

    def step_bytes(self, grad_state=None) -> dict:
        """Logical bytes of one step (design §3.6): boundary messages of every train forward + dp gradient reduce."""
        ticks = self.ticks_per_step
        parts = []
        if self.boundaries:
            a = fbytes.activation_bytes(
                self.fcfg,
                tokens=self.tokens_per_tick // self.dp,
                hidden=self.model_cfg.hidden_size,
                boundaries=self.boundaries,
            )
            parts.append({k: v * ticks for k, v in a.items()})
        if self.dp > 1:
            like = self._params_like if self._params_like is not None else self._params_shapes()
            self._params_like = like
            g = fbytes.grad_allreduce_bytes(like, self.fcfg)
            if (
                self.fcfg.grad_codec == "powersgd"
                and grad_state is not None
                and int(grad_state.step) <= self.fcfg.start_after
            ):
                # the last tick of this step still took the plain-mean branch (warm-up)
                g = dict(g, **{"comm/bytes_compressed": fbytes.powersgd_plain_bytes(like)})
            parts.append({k: v * ticks for k, v in g.items()})
        if not parts:
            return {}
        out = fbytes.combine(*parts)
        return {k: out[k] for k in ("comm/bytes_compressed", "comm/bytes_dense", "comm/bytes_ratio")}

    # --- gradient codec ---------------------------------------------------------------------------------------
    def grad_fn(self, param_shardings):
        """None: XLA's implicit dp mean. PowerSGD: a shard_map over the batch axes around value_and_grad."""
        if self.fcfg.grad_codec != "powersgd":
            return None
        from twocircuit_jax.fast.grad_fn import make_powersgd_grad_fn

        return make_powersgd_grad_fn(self.fcfg, self.mesh, interpret=self.interpret)
