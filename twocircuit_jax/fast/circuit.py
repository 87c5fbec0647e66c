"""The fast circuit as the GRPO loop sees it (design §2, §3): one object that owns the codec choice and its state.

Contract with train/loop.py and train/grpo_step.py (all array state is a pytree of jnp arrays in ctx["codec"]):
  init_state()                      {"steps": [] i32, "lowrank": LowRankState?, "powersgd": PowerSGDState?}
  applies(tag) / hook(state, tag, step, sample_ids, positions, attention_mask) -> (hook_fn, hook_layers)
                                    traced inside jit; `step` is gs (the PRF step key), never the tick
  summarize(aux_by_layer)           scalar codec metrics inside the jitted loss
  grad_fn(param_shardings)          None (XLA's implicit dp mean) or the PowerSGD shard_map factory
  after_tick(state, aux, new_grad_state)   host, after each tick: low-rank sketches, PowerSGD state
  end_step(state, gs)               host, after the last tick: refresh/activate the basis, bytes, counters
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
NEW_STATE = "codec/new_state"  # metrics key carrying PowerSGD's next state out of the train step


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
    def init_state(self, params_like=None) -> dict:
        """{"steps": [] i32 end_step count, "lowrank": LowRankState (lowrank), "powersgd": PowerSGDState}."""
        if params_like is not None:
            self._params_like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params_like)
        rep = NamedSharding(self.mesh, P())
        st = {"steps": jnp.zeros((), jnp.int32)}
        if self.fcfg.codec == "lowrank":
            st["lowrank"] = lr.init_lowrank(self.fcfg, self.model_cfg.hidden_size, self.boundaries)
        st = jax.device_put(st, rep)
        if self.fcfg.grad_codec == "powersgd":
            like = params_like if params_like is not None else self._params_shapes()
            g = psgd.init_powersgd(self.fcfg, like, self.dp)
            specs = psgd.state_specs(g, BATCH_AXES)
            st["powersgd"] = jax.device_put(
                g, jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
            )
        return st

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
                codec_state["lowrank"],
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

    def sketch_hook(self, codec_state, attention_mask):
        """A dense pass that only sketches: activations pass unchanged, the aux carries the sketch Mᵀ(M·Q_start)
        per boundary (`absorb_sketch` folds it into the basis)."""
        return self.basis_sketcher(codec_state["lowrank"], attention_mask)

    def basis_sketcher(self, basis_state, attention_mask):
        """`sketch_hook` on the low-rank basis state alone: what an external dense pass (the anchor's fire) needs."""
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
        st = dict(codec_state)
        st["lowrank"] = self._absorb_jit(st["lowrank"], sketch)
        return st

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
                hook, layers = self.sketch_hook(st, batch["attention_mask"])
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
        st = dict(codec_state)
        low = lr.accumulate_sketch(st["lowrank"], aux)
        st["lowrank"] = lr.activate_staged(lr.refresh_basis(low, self.fcfg, axis_name=None))
        return st, {"codec/bootstrapped": 1}

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
    def after_tick(self, codec_state, aux, new_grad_state=None):
        """Fold one tick's outputs into the state: sketches (fast-owned basis), PowerSGD's next state."""
        self._mid_step = True
        st = dict(codec_state)
        if aux:
            self.applications[TRAIN] += 1
            if self.owns_basis:
                st["lowrank"] = lr.accumulate_sketch(st["lowrank"], aux)
        if new_grad_state is not None:
            st["powersgd"] = new_grad_state
        return st

    def stage_basis(self, codec_state, Q_new: dict):
        """Stage a new basis (anchor-owned case); it becomes active in end_step only."""
        st = dict(codec_state)
        st["lowrank"] = lr.stage(st["lowrank"], Q_new)
        return st

    def activate_basis(self, codec_state):
        """Staged -> active. Refuses inside a step: every forward of a step must see the same basis."""
        if self._mid_step:
            raise RuntimeError(
                "lowrank: a staged basis may become active only after the step's last mini-batch "
                "(design §2 step 5); call end_step"
            )
        st = dict(codec_state)
        st["lowrank"] = lr.activate_staged(st["lowrank"])
        return st

    def end_step(self, codec_state, gs: int):
        st = dict(codec_state)
        metrics = {}
        if "lowrank" in st:
            if self.owns_basis and lr.refresh_due(self.fcfg, gs):
                # The sketch already is the sum over dp: it was contracted over the global batch inside jit
                # (or psum-ed in the PowerSGD shard_map), so no axis_name here.
                st["lowrank"] = lr.refresh_basis(st["lowrank"], self.fcfg, axis_name=None)
            self._mid_step = False
            st = self.activate_basis(st)
            m = lr.lowrank_metrics(st["lowrank"])
            metrics.update({k: float(v) for k, v in m.items()})
            for b in self.boundaries:
                metrics[f"codec/basis_cond/{b}"] = float(lr.basis_cond(st["lowrank"].Q[b]))
        self._mid_step = False
        st["steps"] = st["steps"] + 1
        metrics["codec/steps"] = int(st["steps"])
        metrics.update({f"codec/applications/{k}": v for k, v in self.applications.items()})
        metrics.update(self.step_bytes(st))
        return st, metrics

    def step_bytes(self, codec_state=None) -> dict:
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
                and codec_state is not None
                and int(codec_state["powersgd"].step) <= self.fcfg.start_after
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
