"""The fast circuit as the GRPO loop sees it (design §2, §3): the chosen codecs behind one object.

The activation codec is whichever class registered `fast.codec.type`, the gradient codec whichever registered
`fast.grad_codec.type` (fast/codecs/base.py; `none`: XLA's plain mean). This object holds configuration and host counters only; the array state lives in the circuit
state the loop threads through the step (step/circuit_state.py): `cs.codec` (the activation codec's state: the
low-rank basis, or None) and `cs.grad` (the gradient codec's state: PowerSGD's Q and error memory, or None). Contract with train/loop.py and grpo_step.py:
  init_codec_state() / init_grad_state(params_like)    the two fields, placed on the mesh
  applies(tag) / hook(codec_state, tag, step, sample_ids, positions, attention_mask) -> (hook_fn, hook_layers)
                                    traced inside jit; `step` is gs (the PRF step key), never the tick
  summarize(aux_by_layer)           scalar codec metrics inside the jitted loss
  absorb_aux(codec_state, aux)      traced inside the step: the codec folds the train forward's aux in
  grad_fn(param_shardings)          None (XLA's implicit dp mean) or the gradient codec's shard_map factory
  tick_done()                       host, after each tick (counters)
  state_dict() / load_state_dict(d)       host counters, for the checkpoint meta
  end_step(codec_state, gs, grad_state)   host, after the last tick: the codec's update, bytes, counters
The codec state may change between forwards only in end_step (or `activate_basis`, which refuses to run mid-step),
so no forward inside a step sees a new basis (design §2 step 5).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_kernels.platform import PLATFORMS
from twocircuit_jax.boundaries import boundary_layers
from twocircuit_jax.config.base import ConfigError
from twocircuit_jax.fast import bytes as fbytes
from twocircuit_jax.fast.codecs import OLD, REF, TRAIN, Path, make_activation_codec, make_grad_codec
from twocircuit_jax.fast.codecs.base import row_sum
from twocircuit_jax.fast.grad_fn import make_codec_grad_fn
from twocircuit_jax.names import CODEC_TAGS, DENSE
from twocircuit_jax.parallel.mesh import BATCH_AXES, dp_size


def _rel_err(h, out, attention_mask):
    """‖h − h̃‖_F / ‖h‖_F over real tokens, fp32, outside the gradient path (metric only; codecs/base.py row_sum)."""
    h32 = jax.lax.stop_gradient(h).astype(jnp.float32)
    d = jax.lax.stop_gradient(out).astype(jnp.float32) - h32
    w = jnp.asarray(attention_mask, jnp.float32)
    return jnp.sqrt(row_sum(d * d, w) / jnp.maximum(row_sum(h32 * h32, w), 1e-30))


class FastCircuit:
    def __init__(self, run_cfg, model_cfg, mesh, *, lowering_platform: str | None = None):
        """lowering_platform ("cuda" or "tpu"): build the kernels for that accelerator although the local backend is
        another one, so the train step can be lowered (jax.export, AOT) for it from a CPU host. Lowering only: such
        a step cannot run on CPU (jax's pallas_call has no CPU lowering outside interpret mode). Training never
        sets it; the kernels then target the local backend."""
        f = run_cfg.fast
        self.run_cfg, self.fcfg, self.model_cfg, self.mesh = run_cfg, f, model_cfg, mesh
        # Without an activation codec pp_size only places the logical boundaries the byte accounting counts dense
        # activations at; it is then not checked against the model (config/run.py), so it is capped at the layers.
        pp = f.pp_size if f.codec_type != "none" else min(f.pp_size, model_cfg.num_layers)
        try:
            self.boundaries = boundary_layers(model_cfg.num_layers, pp)
        except ValueError as e:
            raise ConfigError("fast.pp_size", str(e)) from None
        self.interpret = bool(f.kernel_interpret)
        if lowering_platform is not None and lowering_platform not in PLATFORMS:
            raise ValueError(f"lowering_platform: got {lowering_platform!r}; allowed {', '.join(PLATFORMS)} or None")
        if lowering_platform is not None and self.interpret:
            raise ConfigError(
                "fast.kernel_interpret", "interpret mode runs on the host; it cannot be lowered for an accelerator"
            )
        self.lowering_platform = lowering_platform
        try:
            self.codec = make_activation_codec(
                f.codec,
                hidden=model_cfg.hidden_size,
                boundaries=self.boundaries,
                mesh=mesh,
                interpret=self.interpret,
                platform=lowering_platform,
                owns_basis=not run_cfg.anchor_owns_q,
            )
        except ValueError as e:
            raise ConfigError("fast.codec", str(e)) from None
        self.has_activation_codec = self.codec is not None
        self.grad_codec = make_grad_codec(f.grad_codec, mesh=mesh, interpret=self.interpret, platform=lowering_platform)
        self._check_kernels()
        self._check_stages()
        self.dp = dp_size(mesh)
        if self.grad_codec is not None:
            try:
                self.grad_codec.check_mesh(mesh)
            except ValueError as e:
                raise ConfigError("fast.grad_codec", str(e)) from None
        t = run_cfg.train
        # Tokens one replica sends per tick across a boundary: its share of the mini-batch's padded [B, T] (what a
        # pipeline link would carry), so activation and gradient bytes are both per replica. Train forwards per
        # step: ticks_per_step * ppo_epochs (design §3.6: the gradient-bearing forward only).
        self.tokens_per_tick = (
            t.prompts_per_update * run_cfg.sampler.n * (t.max_prompt_len + run_cfg.sampler.sampling.max_new_tokens)
        )
        self.ticks_per_step = run_cfg.ticks_per_step * t.ppo_epochs
        self.applications = {TRAIN: 0, OLD: 0, REF: 0}  # host counters: codec forwards executed, per tag
        self.steps = 0  # host counter: end_step calls
        self._mid_step = False
        self._params_like = None

    def _check_stages(self):
        """On real stages (mesh.stage > 1) the activation codec needs a wire format, and the gradient codec's
        shard_map over the batch axes does not nest the pipeline's (not built): both refused up front."""
        if self.mesh.shape.get("stage", 1) == 1:
            return
        if self.codec is not None:
            try:  # a format is built per microbatch inside the step; probe it here with shapes only
                probe = Path(
                    TRAIN,
                    jnp.zeros((), jnp.int32),
                    jnp.zeros((1,), jnp.int32),
                    jnp.zeros((1, 1), jnp.int32),
                    jnp.ones((1, 1), jnp.int32),
                )
                jax.eval_shape(
                    lambda: self.codec.wire(self.init_codec_state_shapes(), self.boundaries[0], probe).payload_like(
                        jax.ShapeDtypeStruct((1, 1, self.model_cfg.hidden_size), jnp.float32)
                    )
                )
            except ValueError as e:
                raise ConfigError("fast.codec", str(e)) from None

    def init_codec_state_shapes(self):
        return jax.eval_shape(self.codec.init) if self.codec is not None else None

    @property
    def owns_basis(self) -> bool:
        return bool(getattr(self.codec, "owns_basis", False))

    def _check_kernels(self):
        """A kernel asked for must be able to run (or, with an explicit lowering platform, be lowered): there is no
        silent fallback to the jnp reference."""
        f = self.fcfg
        asked = [
            (path, sec)
            for path, sec in (("fast.codec.use_kernel", f.codec), ("fast.grad_codec.use_kernel", f.grad_codec))
            if getattr(sec, "use_kernel", False)
        ]
        for path, codec, name in (
            ("fast.codec.use_kernel", self.codec, f.codec_type),
            ("fast.grad_codec.use_kernel", self.grad_codec, f.grad_codec_type),
        ):
            if codec is not None and getattr(codec.cfg, "use_kernel", False) and not codec.has_kernel:
                raise ConfigError(path, f"{name} has no Pallas kernel; set it false")
        if asked and jax.default_backend() == "cpu" and not self.interpret and self.lowering_platform is None:
            raise ConfigError(
                asked[0][0],
                "the Pallas kernels cannot be compiled on the CPU backend; set it false (jnp reference) or "
                "fast.kernel_interpret=true (interpret mode, tests only); there is no silent fallback",
            )

    # --- state ------------------------------------------------------------------------------------------------
    def init_codec_state(self):
        """The activation codec's state, replicated (the low-rank basis), or None for a stateless codec."""
        st = self.codec.init() if self.codec is not None else None
        return None if st is None else jax.device_put(st, NamedSharding(self.mesh, P()))

    def init_grad_state(self, params_like=None):
        """The gradient codec's state placed by its `global_specs` (PowerSGD: Q replicated, the per-replica error
        memory split over dp; with real stages, each stage holds its own layers' Q and e; hierarchical, one e per
        data replica split like its parameter over fsdp/tensor), or None."""
        if params_like is not None:
            self._params_like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params_like)
        if self.grad_codec is None:
            return None
        like = params_like if params_like is not None else self._params_shapes()
        g = self.grad_codec.init(like, self.grad_replicas)
        return jax.device_put(g, self.grad_state_shardings(g))

    @property
    def grad_axes(self) -> tuple:
        """The mesh axes the gradient codec's shard_map is manual over and reduces across: the batch axes, or
        `data` alone for a hierarchical codec (PowerSGD with fsdp/tensor > 1, fast/powersgd.py). The loss's
        diagnostics gather their rows over these (step/grpo_step.py `rows_over`)."""
        return getattr(self.grad_codec, "replica_axes", None) or BATCH_AXES

    @property
    def grad_replicas(self) -> int:
        """Replicas the gradient codec keeps state for (PowerSGD: one error memory each): the product of
        `grad_axes`' sizes (dp, or mesh.data when hierarchical)."""
        n = 1
        for a in self.grad_axes:
            n *= self.mesh.shape[a]
        return n

    def grad_state_shardings(self, grad_state):
        if grad_state is None:
            return None
        specs = self.grad_codec.global_specs(grad_state, BATCH_AXES)
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs, is_leaf=lambda x: isinstance(x, P))

    def _params_shapes(self):
        from twocircuit_jax.model.qwen2 import init_params  # shapes only: eval_shape allocates nothing

        return jax.eval_shape(lambda: init_params(self.model_cfg, jax.random.key(0)))

    # --- the boundary hook ------------------------------------------------------------------------------------
    def applies(self, tag: str) -> bool:
        if tag == DENSE:
            return False
        if tag not in CODEC_TAGS:
            raise ValueError(f"unknown forward tag {tag!r}; allowed {TRAIN}, {OLD}, {REF}, {DENSE}")
        if not self.has_activation_codec:
            return False
        return {TRAIN: True, OLD: self.fcfg.codec_old_logprob, REF: self.fcfg.codec_reference}[tag]

    def hook(self, codec_state, tag, step, sample_ids, positions, attention_mask):
        """(hook_fn, hook_layers) for one forward. A dense-path tag is a hard error (design §3.1)."""
        if tag == DENSE or not self.applies(tag):
            raise ValueError(
                f"fast circuit: no codec may act on the {tag!r} path (fast.codec={self.fcfg.codec_type}, "
                f"codec_old_logprob={self.fcfg.codec_old_logprob}, "
                f"codec_reference={self.fcfg.codec_reference})"
            )
        path = Path(tag, step, sample_ids, positions, attention_mask)

        def fn(layer, h):
            out, aux = self.codec.hook(codec_state, layer, h, path)
            if "recon_rel_err" not in aux:
                aux = dict(aux, recon_rel_err=_rel_err(h, out, attention_mask))
            return out, aux

        return fn, self.boundaries

    def boundary_fn(self, codec_state, tag, step):
        """For parallel.pipeline.forward: fn(rows of one (micro)batch) -> (hook, layers, wires), or None when no
        codec acts on `tag`. Wires (the packed formats, fast/wire.py) are built only on a staged mesh."""
        if not self.applies(tag):
            return None
        staged = self.mesh.shape.get("stage", 1) > 1

        def fn(mb):
            ctx = (mb["sample_id"], mb["positions"], mb["attention_mask"])
            hook, layers = self.hook(codec_state, tag, step, *ctx)
            path = Path(tag, step, *ctx)
            wires = {b: self.codec.wire(codec_state, b, path) for b in layers} if staged else {}
            return hook, layers, wires

        return fn

    # --- the basis, when the codec learns one (fast.codec.learns_basis; wired by the loop) ----------------------
    def basis_sketcher(self, basis_state, attention_mask):
        """A dense pass that only sketches (the anchor's fire takes it from the loop); see LowRankCodec.sketcher."""
        return self.codec.sketcher(basis_state, attention_mask)

    def absorb_sketch(self, codec_state, sketch):
        """Fold a dense pass's sketch in: one power-iteration step, staged until end_step."""
        return self.codec.absorb_sketch(codec_state, sketch)

    def bootstrap(self, codec_state, params, batch):
        """Before the first compressed forward of a fresh run: the codec's bootstrap, if it has one. Returns
        (state, metrics)."""
        boot = getattr(self.codec, "bootstrap", None)
        if boot is None:
            return codec_state, {}
        if self._mid_step:
            raise RuntimeError(f"{self.codec.name} bootstrap must run before the first compressed forward of the run")
        return boot(codec_state, params, batch, self.model_cfg)

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
        """Traced inside the train step: the codec folds the train forward's aux (summed over the global batch) into
        its state (a fast-owned basis adds its sketch); a stateless codec passes it through."""
        return self.codec.absorb(codec_state, aux) if self.codec is not None else codec_state

    def tick_done(self):
        """Host, after each tick: one more train-path codec forward ran; the step has started."""
        self._mid_step = True
        if self.has_activation_codec:
            self.applications[TRAIN] += 1

    def count_forward(self, tag: str) -> None:
        """Host: one more codec forward on the `tag` path that ran inside another pass (the old-log-prob view the
        loop takes from a tick's train forward)."""
        if tag not in self.applications:
            raise ValueError(f"unknown forward tag {tag!r}; allowed {', '.join(self.applications)}")
        self.applications[tag] += 1

    # --- host state (checkpoint meta) ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The host counters: {"applications": {tag: forwards}, "steps": end_step calls} (JSON values)."""
        return {"applications": dict(self.applications), "steps": self.steps}

    def load_state_dict(self, d: dict) -> None:
        """Counters from `state_dict`; a tag the dict lacks starts at 0."""
        apps = {TRAIN: 0, OLD: 0, REF: 0}
        apps.update({str(k): int(v) for k, v in d["applications"].items()})
        self.applications, self.steps = apps, int(d["steps"])

    def stage_basis(self, codec_state, Q_new: dict):
        """Stage a new basis (anchor-owned case); it becomes active in end_step only."""
        return self.codec.stage(codec_state, Q_new)

    def activate_basis(self, codec_state):
        """Staged -> active. Refuses inside a step: every forward of a step must see the same basis."""
        if self._mid_step:
            raise RuntimeError(
                f"{self.codec.name}: a staged basis may become active only after the step's last mini-batch "
                "(design §2 step 5); call end_step"
            )
        return self.codec.activate_staged(codec_state)

    def end_step(self, codec_state, gs: int, grad_state=None):
        """Host, after the step's last tick: (codec_state', metrics). The codec's update (a basis refresh when due
        and the activation of a staged one), counters, and the step's logical bytes."""
        self._mid_step = False
        metrics = {}
        if self.codec is not None:
            codec_state, metrics = self.codec.update(codec_state, gs)
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
            tokens, hidden = self.tokens_per_tick // self.dp, self.model_cfg.hidden_size
            if self.codec is not None:
                a = self.codec.wire_bytes(tokens, hidden, self.boundaries)
            else:
                a = fbytes.activation_bytes(self.fcfg.codec, tokens=tokens, hidden=hidden, boundaries=self.boundaries)
            parts.append({k: v * ticks for k, v in a.items()})
        if self.dp > 1:
            like = self._params_like if self._params_like is not None else self._params_shapes()
            self._params_like = like
            if self.grad_codec is None:
                g = fbytes.dense_grad_bytes(like)
            else:  # `grad_state` tells a codec with a warm-up which branch the step's last tick took
                g = self.grad_codec.wire_bytes(like, grad_state)
            parts.append({k: v * ticks for k, v in g.items()})
        if not parts:
            return {}
        out = fbytes.combine(*parts)
        return {k: out[k] for k in ("comm/bytes_compressed", "comm/bytes_dense", "comm/bytes_ratio")}

    # --- gradient codec ---------------------------------------------------------------------------------------
    def grad_fn(self, param_shardings, micro_batch: int = 0, phase: str | None = None):
        """None: XLA's implicit dp mean. A gradient codec: a shard_map over the batch axes around value_and_grad,
        accumulated over micro-batches of `micro_batch` rows per device (train.micro_batch_per_device; 0 = one pass). Manual
        over `data` only (hierarchical), a replica's rows are its fsdp x tensor devices' rows: its micro-batch is
        that many devices' micro-batches, which the partitioner splits over them again. `phase`: the codec's warm-up
        or steady reduction alone (fast/grad_fn.py make_codec_grad_fn)."""
        if self.grad_codec is None:
            return None
        group = dp_size(self.mesh) // self.grad_replicas
        return make_codec_grad_fn(self.grad_codec, self.mesh, micro_batch=micro_batch * group, phase=phase)
