"""Config sections of one run. Keys follow the public interface (docs/design.md §9, the README); metadata names the paper symbol."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal, Optional

from twocircuit_jax.config.anchor import AnchorConfig  # noqa: F401  (a section of RunConfig; its own module)
from twocircuit_jax.config.base import doc, register, require, type_name


@dataclass(frozen=True)
class ModelConfig:
    """Qwen2-family decoder shape. `init` builds random weights; `hf_dir` / `checkpoint` load them."""

    vocab_size: int = field(
        default=100, metadata=doc("embedding and logit rows; at least the tokenizer's vocabulary size (char: 100)")
    )
    hidden_size: int = field(default=64, metadata=doc("width of the residual stream (boundary activations)", "H"))
    num_layers: int = field(default=4, metadata=doc("decoder layers", "L"))
    num_heads: int = field(default=2, metadata=doc("query heads per layer"))
    num_kv_heads: int = field(
        default=1, metadata=doc("key/value heads per layer (grouped-query attention); must divide num_heads")
    )
    head_dim: int = field(default=32, metadata=doc("width of one attention head"))
    intermediate_size: int = field(default=128, metadata=doc("hidden width of the SwiGLU MLP"))
    rope_theta: float = field(default=10000.0, metadata=doc("RoPE base frequency"))
    rms_norm_eps: float = field(default=1e-6, metadata=doc("epsilon inside RMSNorm"))
    tie_embeddings: bool = field(default=True, metadata=doc("lm_head reuses the embedding matrix"))
    qkv_bias: bool = field(default=True, metadata=doc("bias on the q, k and v projections (Qwen2)"))
    qk_norm: bool = field(default=False, metadata=doc("Qwen3 per-head RMSNorm on q and k"))
    max_position_embeddings: int = field(
        default=4096, metadata=doc("context length written to and read from the HF config.json; not enforced here")
    )
    param_dtype: Literal["float32", "bfloat16"] = field(
        default="float32", metadata=doc("dtype the weights are stored in; the run's value wins over base_model's")
    )
    compute_dtype: Literal["float32", "bfloat16"] = field(
        default="float32", metadata=doc("dtype of matmuls and activations; norms and logits stay fp32")
    )
    bos_token_id: Optional[int] = field(default=None, metadata=doc("BOS id written to the HF config.json; None = none"))
    eos_token_id: int = field(default=2, metadata=doc("id that ends a generation; must equal the tokenizer's"))
    pad_token_id: int = field(default=0, metadata=doc("id the sampler pads prompts and completions with"))
    logits_chunk: int = field(
        default=512,
        metadata=doc(
            "positions per chunk of the train passes' LM head (model/head.py): log-probs and entropies without the "
            "whole [B, T, V] logits, the backward recomputing one chunk's logits at a time (one more head matmul); "
            "0, or a chunk covering the sequence (T <= 513 at the default: every tiny config) = whole logits"
        ),
    )
    # How the training forward runs (docs/architecture.md "Model forward"): no effect on its values beyond float
    # rounding, and with base_model the run's values win over the checkpoint's (train/setup.py _RUN_OWNED).
    remat: Literal["none", "full", "dots"] = field(
        default="none",
        metadata=doc(
            "activation rematerialisation per decoder layer: none = keep every activation for the backward; full = "
            "keep only each layer's input and recompute the layer in the backward; dots = keep the outputs of the "
            "projection and MLP matmuls (jax.checkpoint_policies.dots_with_no_batch_dims_saveable) and recompute "
            "attention scores, norms and activations"
        ),
    )
    scan_layers: bool = field(
        default=False,
        metadata=doc(
            "run each run of layers between hooked layers as one jax.lax.scan: compile time and program size stop "
            "growing with depth (off: a Python loop, faster on a tiny model)"
        ),
    )
    attention: Literal["auto", "xla", "blockwise", "cudnn", "flash_tpu"] = field(
        default="auto",
        metadata=doc(
            "training-path attention: xla = full [T, T] scores; blockwise = query blocks of attention_block rows, "
            "each recomputed in the backward (never [T, T]); cudnn = cuDNN fused attention (GPU, bf16); flash_tpu = "
            "the Pallas TPU flash kernel; auto = flash_tpu on TPU (lengths a multiple of 128), cudnn on GPU with bf16 "
            "compute, else xla below "
            "2048 tokens and blockwise from there. The sampler's decode keeps the xla path"
        ),
    )
    attention_block: int = field(default=512, metadata=doc("query rows per block of the blockwise attention"))

    def check(self):
        require(self.attention_block >= 1, "attention_block", f"got {self.attention_block}; must be >= 1")
        require(
            not (self.attention == "cudnn" and self.compute_dtype == "float32"),
            "attention",
            "got 'cudnn' with compute_dtype float32; cuDNN fused attention runs in bfloat16 only: set "
            "model.compute_dtype=bfloat16 or pick xla/blockwise",
        )
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
        ):
            require(getattr(self, name) >= 1, name, f"got {getattr(self, name)}; must be >= 1")
        require(
            self.num_heads % self.num_kv_heads == 0,
            "num_kv_heads",
            f"got {self.num_kv_heads}; must divide num_heads={self.num_heads}",
        )
        require(self.rope_theta > 0, "rope_theta", f"got {self.rope_theta}; must be > 0")
        require(self.logits_chunk >= 0, "logits_chunk", f"got {self.logits_chunk}; must be >= 0 (0 = whole logits)")


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh. `data`, `stage`, `fsdp`, `tensor` are sizes inside one island (a TPU slice, a GPU node: the fast
    links); `dcn_*` count the islands each axis spans over the slow link (DCN between slices). An axis's size is
    island size x dcn size (MaxText's ici x dcn: `data: 2, dcn_data: 2` is 4 replicas), and all of them multiply to
    the device count; -1 on one in-island axis takes what the island leaves."""

    data: int = field(default=-1, metadata=doc("data-parallel replicas; -1 = the devices the other axes leave"))
    fsdp: int = field(
        default=1,
        metadata=doc("devices each parameter is sharded over (the batch is split over it too); -1 = the rest"),
    )
    tensor: int = field(default=1, metadata=doc("tensor-parallel devices per matmul; -1 = the rest"))
    stage: int = field(
        default=1,
        metadata=doc("pipeline stages: the layer stack split at the fast circuit's boundaries, one part per stage"),
    )
    dcn_data: int = field(
        default=1,
        metadata=doc(
            "islands (TPU slices; fast-link groups) the data axis spans over the slow link: data replicas = "
            "data x dcn_data (MaxText's ici x dcn)"
        ),
    )
    dcn_stage: int = field(
        default=1, metadata=doc("islands the stage axis spans over the slow link: stages = stage x dcn_stage")
    )
    dcn_fsdp: int = field(
        default=1,
        metadata=doc("islands the fsdp axis spans over the slow link (fsdp x dcn_fsdp); > 1 needs allow_slow_sharding"),
    )
    dcn_tensor: int = field(
        default=1,
        metadata=doc(
            "islands the tensor axis spans over the slow link (tensor x dcn_tensor); > 1 needs allow_slow_sharding"
        ),
    )
    allow_slow_sharding: bool = field(
        default=False,
        metadata=doc(
            "allow dcn_fsdp or dcn_tensor > 1: per-layer parameter gathers and activation reductions over the slow "
            "link, uncompressed by the fast circuit"
        ),
    )

    DCN = ("dcn_data", "dcn_stage", "dcn_fsdp", "dcn_tensor")

    @property
    def stages(self) -> int:
        """Pipeline stages in all: stage x dcn_stage."""
        return self.stage * self.dcn_stage

    def check(self):
        sizes = (self.data, self.fsdp, self.tensor)
        require(sum(s == -1 for s in sizes) <= 1, "data", "at most one mesh axis may be -1")
        for n, s in zip(("data", "fsdp", "tensor"), sizes):
            require(s == -1 or s >= 1, n, f"got {s}; must be >= 1 or -1")
        require(self.stage >= 1, "stage", f"got {self.stage}; must be >= 1 (-1 is not allowed on the stage axis)")
        for n in self.DCN:
            v = getattr(self, n)
            require(v >= 1, n, f"got {v}; must be >= 1 (islands over the slow link; -1 is not allowed)")
        for n in ("dcn_fsdp", "dcn_tensor"):
            v = getattr(self, n)
            require(
                v == 1 or self.allow_slow_sharding,
                n,
                f"got {v}: that puts {n[4:]} (a collective per layer, uncompressed) across the slow link; keep it "
                "inside an island and span islands with dcn_data or dcn_stage, or set mesh.allow_slow_sharding: true",
            )


@dataclass(frozen=True)
class OptimConfig:
    lr: float = field(default=1e-6, metadata=doc("AdamW learning rate", "η"))
    weight_decay: float = field(default=0.01, metadata=doc("AdamW decoupled weight decay"))
    b1: float = field(default=0.9, metadata=doc("Adam first-moment decay, in [0, 1)"))
    b2: float = field(default=0.999, metadata=doc("Adam second-moment decay, in [0, 1)"))
    eps: float = field(default=1e-8, metadata=doc("Adam denominator epsilon"))
    warmup_steps: int = field(default=0, metadata=doc("linear warm-up in optimizer ticks"))
    grad_clip: float = field(default=1.0, metadata=doc("global-norm clip; 0 disables"))

    def check(self):
        require(self.lr > 0, "lr", f"got {self.lr}; must be > 0")
        require(self.grad_clip >= 0, "grad_clip", f"got {self.grad_clip}; must be >= 0")
        require(0 <= self.b1 < 1 and 0 <= self.b2 < 1, "b1", "betas must be in [0, 1)")


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = field(
        default=1.0, metadata=doc("sampling temperature; rollouts require 1 (their log-probs must match the trainer's)")
    )
    top_p: float = field(default=1.0, metadata=doc("nucleus cut in (0, 1]; rollouts require 1 (off)"))
    top_k: int = field(default=0, metadata=doc("keep the k likeliest tokens; 0 = off, which rollouts require"))
    max_new_tokens: int = field(
        default=32, metadata=doc("generation cap in tokens per completion (per action in an env); the overlong limit")
    )

    def check(self):
        require(self.temperature >= 0, "temperature", f"got {self.temperature}; must be >= 0")
        require(0 < self.top_p <= 1, "top_p", f"got {self.top_p}; allowed (0, 1]")
        require(self.top_k >= 0, "top_k", f"got {self.top_k}; must be >= 0 (0 = off)")
        require(self.max_new_tokens >= 1, "max_new_tokens", f"got {self.max_new_tokens}; must be >= 1")


@dataclass(frozen=True)
class SamplerConfig:
    """Who generates rollouts. Rollouts use temperature 1 with no truncation so log-probs compare (design §1)."""

    backend: Literal["jax", "vllm"] = field(
        default="jax",
        metadata=doc(
            "jax = the embedded sampler; vllm = a vLLM server process (with many trainer processes: driven by "
            "process 0, docs/scale.md)"
        ),
    )
    n: int = field(default=4, metadata=doc("samples per prompt (group size)", "G"))
    sampling: SamplingConfig = SamplingConfig()
    max_rows_per_call: int | Literal["auto"] = field(
        default="auto",
        metadata=doc(
            "jax: rows of one generate call (whole groups of n; a step's rows take several calls); auto = sized "
            "from the device memory free at the first call (all rows at once where the backend reports none, e.g. "
            "CPU); `twocircuit plan` prints the size it compiled"
        ),
    )
    max_staleness: int = field(
        default=0,
        metadata=doc("weight versions a rollout may lag the trainer beyond train.async_rollouts' scheduled lag"),
    )
    host: str = field(
        default="127.0.0.1",
        metadata=doc("vllm: address the sampler server listens on; a loopback address unless allow_remote"),
    )
    allow_remote: bool = field(
        default=False,
        metadata=doc(
            "vllm: allow a non-loopback host. Risk: anyone who can reach the port and learns the run's secret (sent "
            "in clear text over HTTP on every request) can generate with the policy and make it load any export "
            "folder under export_dir; use only on a network you trust, behind a firewall"
        ),
    )
    port: int = field(default=0, metadata=doc("vllm: server port; 0 = pick a free one"))
    gpu_memory_utilization: float = field(
        default=0.2, metadata=doc("vllm: share of GPU memory the server may take, in (0, 1]")
    )
    startup_timeout_s: float = field(
        default=300.0, metadata=doc("vllm: seconds to wait for the server to report ready")
    )
    request_timeout_s: float = field(
        default=600.0, metadata=doc("vllm: seconds one generate or weight-load request may take")
    )
    max_retries: int = field(
        default=2, metadata=doc("vllm: extra attempts of a failed request, restarting a dead server")
    )
    stall_timeout_s: float = field(
        default=0.0,
        metadata=doc(
            "vllm: the server's /health reports it stuck (and a failed request restarts it) once generate or "
            "weight-load requests have been in flight this long with none answered; 0 = request_timeout_s"
        ),
    )
    export_dir: str = field(
        default="",
        metadata=doc(
            "vllm: folder of weight exports the server loads; '' = <run dir>/sampler/exports; 'shm' = a fresh "
            "folder in shared memory (/dev/shm, trainer and sampler on one host), removed when the run ends"
        ),
    )
    weight_sync: Literal["delta", "full"] = field(
        default="delta",
        metadata=doc(
            "vllm: delta = write only the words that changed since the served version (lossless, hash-checked; "
            "a refused delta is sent again whole); full = every version whole"
        ),
    )
    full_every: int = field(default=20, metadata=doc("vllm: with delta sync, every n-th version is written whole"))
    weight_update: Literal["inplace", "reload"] = field(
        default="inplace",
        metadata=doc(
            "vllm: how a delta reaches the engine: inplace = its changed words are written into the engine's "
            "tensors (only on the tested vLLM release, sampler/vllm_pin.py: the server refuses another); reload = "
            "the touched modules are reloaded whole (where vLLM packs weights, e.g. AMX CPUs; another vLLM release starts with a warning)"
        ),
    )
    dtype: Literal["auto", "float32", "bfloat16"] = field(
        default="auto", metadata=doc("vllm: the engine's weight dtype, and so the exports'; auto = model.param_dtype")
    )
    engines: int = field(
        default=1,
        metadata=doc(
            "vllm: engine processes this trainer starts (a fleet when > 1 or with endpoints: a step's prompt groups "
            "are split over them, docs/sampler.md)"
        ),
    )
    devices: tuple[tuple[int, ...], ...] = field(
        default=(),
        metadata=doc(
            "vllm: one list of host GPU indices per local engine (its CUDA_VISIBLE_DEVICES); the trainer sees only "
            "the GPUs no engine owns; [] = engines and trainer share what the host shows them"
        ),
    )
    tensor_parallel: int = field(
        default=1,
        metadata=doc(
            "vllm: GPUs per engine (vLLM's tensor_parallel_size); equals each devices list's length when devices is "
            "set; > 1 needs weight_update: reload"
        ),
    )
    endpoints: tuple[str, ...] = field(
        default=(),
        metadata=doc(
            "vllm: HOST:PORT of engines started elsewhere by `twocircuit serve-sampler` with --export-root = "
            "export_dir; they serve beside the `engines` local ones (engines: 0 = endpoints only)"
        ),
    )
    secret_file: str = field(
        default="",
        metadata=doc(
            "vllm: file holding the endpoints' secret (else env TWOCIRCUIT_SAMPLER_TOKEN); serve-sampler reads it "
            "too. Never put the secret itself in a config or on a command line"
        ),
    )

    def check(self):
        require(self.n >= 1, "n", f"got {self.n}; must be >= 1")
        s = self.sampling
        for name, value, policy in (
            ("temperature", s.temperature, 1.0),
            ("top_p", s.top_p, 1.0),
            ("top_k", s.top_k, 0),
        ):
            require(
                value == policy,
                f"sampling.{name}",
                f"got {value}; rollouts sample the policy itself (temperature 1, top_p 1, top_k 0): the PPO ratio, "
                "truncated IS and the mismatch metrics compare the sampler's log-probs with the trainer's, which are "
                "the untempered, untruncated policy's (design §1). Held-out evaluation is greedy "
                "(train.eval_greedy: true) or samples at temperature 1",
            )
        require(self.max_staleness >= 0, "max_staleness", f"got {self.max_staleness}; must be >= 0")
        require(
            self.max_rows_per_call == "auto" or self.max_rows_per_call >= self.n,
            "max_rows_per_call",
            f"got {self.max_rows_per_call}; must be 'auto' or at least sampler.n = {self.n} (a group is one call)",
        )
        require(0 <= self.port < 65536, "port", f"got {self.port}; allowed 0..65535 (0 = pick a free port)")
        from twocircuit_jax.sampler.http_guard import is_loopback

        require(
            self.allow_remote or is_loopback(self.host),
            "host",
            f"got {self.host!r}, not a loopback address (127.0.0.1, ::1, localhost); the sampler would accept "
            "connections from other machines. Set sampler.allow_remote: true to allow it",
        )
        require(self.stall_timeout_s >= 0, "stall_timeout_s", f"got {self.stall_timeout_s}; must be >= 0")
        require(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "allowed (0, 1]")
        require(self.full_every >= 1, "full_every", f"got {self.full_every}; must be >= 1")
        self._check_fleet()

    def _check_fleet(self):
        """The fleet's own fields; what depends on the host (its GPU count) is checked by sampler/placement.py at
        train start, so a config written on a GPU host still loads elsewhere (eval, plan)."""
        require(self.engines >= 0, "engines", f"got {self.engines}; must be >= 0")
        if self.backend != "vllm":
            for name, value, default in (
                ("engines", self.engines, 1),
                ("devices", self.devices, ()),
                ("endpoints", self.endpoints, ()),
                ("tensor_parallel", self.tensor_parallel, 1),
            ):
                require(value == default, name, f"got {value!r}; engine placement applies to sampler.backend: vllm")
        require(
            self.engines >= 1 or self.endpoints,
            "engines",
            "got 0 and no sampler.endpoints; at least one engine must serve (engines >= 1 or endpoints set)",
        )
        require(self.tensor_parallel >= 1, "tensor_parallel", f"got {self.tensor_parallel}; must be >= 1")
        # With TP > 1 the engine's weights are shards in vLLM's worker processes: the in-place path writes the
        # tensors of the process serving HTTP (LLM.apply_model's first worker), so it cannot address them.
        require(
            self.tensor_parallel == 1 or self.weight_update == "reload",
            "weight_update",
            f"got inplace with sampler.tensor_parallel={self.tensor_parallel}; an in-place write cannot reach "
            "tensor-parallel shards: set sampler.weight_update: reload",
        )
        if self.devices:
            require(
                len(self.devices) == self.engines,
                "devices",
                f"got {len(self.devices)} lists for sampler.engines={self.engines}; one GPU list per local engine",
            )
            seen = {}
            for k, lst in enumerate(self.devices):
                require(
                    bool(lst) and all(d >= 0 for d in lst),
                    "devices",
                    f"engine {k}: got {lst!r}; a non-empty list of GPU indices >= 0",
                )
                require(
                    len(lst) == self.tensor_parallel,
                    "devices",
                    f"engine {k} has {len(lst)} GPUs {list(lst)}, sampler.tensor_parallel={self.tensor_parallel}; "
                    "each engine's list holds tensor_parallel GPUs",
                )
                for d in lst:
                    require(
                        d not in seen or seen[d] == k,
                        "devices",
                        f"GPU {d} is given to engines {seen.get(d)} and {k}; engines' GPU lists must not overlap",
                    )
                    require(list(lst).count(d) == 1, "devices", f"engine {k} names GPU {d} twice: {list(lst)}")
                    seen[d] = k
        for e in self.endpoints:
            host, sep, port = str(e).rpartition(":")
            require(
                bool(sep and host and port.isdigit() and 0 < int(port) < 65536),
                "endpoints",
                f"got {e!r}; each endpoint is HOST:PORT with a port in 1..65535",
            )
        if self.endpoints:
            require(
                self.export_dir not in ("", "shm"),
                "export_dir",
                f"got {self.export_dir!r} with sampler.endpoints set; remote engines load versions from a folder "
                "every host reads: set export_dir to it (the engines' --export-root)",
            )


@dataclass(frozen=True)
class MismatchMaskConfig:
    """Which rollouts the policy loss drops for their sampler-trainer mismatch (grpo/tis.py), by ρ = π_old/π_sampler;
    the subclass is chosen by `type:`. A dropped token keeps its place in the loss's normaliser, with weight 0."""

    default_type = "none"
    low: ClassVar[float] = 0.0
    high: ClassVar[float] = 0.0

    def check(self):
        require(0 < self.low <= 1, "low", f"got {self.low}; allowed (0, 1]")
        require(self.high >= 1, "high", f"got {self.high}; must be >= 1")


@register(MismatchMaskConfig, "none")
@dataclass(frozen=True)
class NoMismatchMask(MismatchMaskConfig):
    """No mask: every response token is in the loss."""

    def check(self):
        pass


@register(MismatchMaskConfig, "geometric")
@dataclass(frozen=True)
class GeometricMask(MismatchMaskConfig):
    """A whole sequence out when the geometric mean of its token ratios, exp(mean_t log ρ_t), leaves [low, high]."""

    low: float = field(default=0.99, metadata=doc("lowest geometric-mean ratio kept"))
    high: float = field(default=1.01, metadata=doc("highest geometric-mean ratio kept"))


@register(MismatchMaskConfig, "icepop")
@dataclass(frozen=True)
class IcePopMask(MismatchMaskConfig):
    """IcePop: a token out when its ratio ρ_t leaves [low, high]; a kept token is weighted by ρ_t (so grpo.tis must
    be off: the ratio is already applied)."""

    low: float = field(default=0.5, metadata=doc("lowest token ratio kept"))
    high: float = field(default=2.0, metadata=doc("highest token ratio kept"))


@dataclass(frozen=True)
class GRPOConfig:
    """GRPO objective (design §5)."""

    std_normalize: bool = field(default=True, metadata=doc("divide advantages by group std"))
    adv_std: Literal["unbiased", "population"] = field(
        default="unbiased", metadata=doc("group std of the advantage: ddof=1 (verl's GRPO) or ddof=0 (TRL)", "σ_g")
    )
    clip_low: float = field(default=0.2, metadata=doc("lower PPO clip", "ε_low"))
    clip_high: float = field(default=0.28, metadata=doc("upper PPO clip", "ε_high"))
    dual_clip: float = field(default=3.0, metadata=doc("dual-clip bound for A<0; 0 disables", "c"))
    kl_coef: float = field(default=0.001, metadata=doc("reference KL coefficient", "β"))
    kl_estimator: Literal["k1", "k3", "low_var_kl"] = field(
        default="low_var_kl",
        metadata=doc("per-token KL to the reference: k1 = log ratio; k3, low_var_kl = e^d - d - 1 clamped to ±10"),
    )
    entropy_coeff: float = field(
        default=0.0, metadata=doc("weight of the entropy bonus subtracted from the loss; 0 = off")
    )
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = field(
        default="token-mean",
        metadata=doc("token losses averaged over all tokens, or per sequence (sum, mean, sum / T) then over sequences"),
    )
    tis: Literal["off", "token", "sequence"] = field(
        default="off",
        metadata=doc(
            "truncated IS of trainer vs sampler log-probs: off, per-token or per-sequence weights capped at tis_cap"
        ),
    )
    tis_cap: float = field(default=2.0, metadata=doc("truncated IS cap", "C"))
    is_mask: MismatchMaskConfig = field(
        default_factory=NoMismatchMask,
        metadata=doc("rollouts left out of the policy loss for their mismatch: none, geometric (sequences), icepop"),
    )
    overlong_mode: Literal["zero", "mask", "soft"] = field(
        default="zero",
        metadata=doc("truncated completions: zero = reward 0; mask = left out of the loss; soft = DAPO length penalty"),
    )
    overlong_buffer: int = field(
        default=8, metadata=doc("soft: tokens before the cap over which the penalty falls from 0 to -1")
    )
    format_penalty: float = field(default=0.0, metadata=doc("reward for an unparsable answer"))

    def check(self):
        require(0 <= self.clip_low < 1, "clip_low", f"got {self.clip_low}; allowed [0, 1)")
        require(self.clip_high >= 0, "clip_high", f"got {self.clip_high}; must be >= 0")
        require(self.dual_clip == 0 or self.dual_clip > 1, "dual_clip", f"got {self.dual_clip}; 0 (off) or > 1")
        require(self.kl_coef >= 0, "kl_coef", f"got {self.kl_coef}; must be >= 0")
        require(self.tis_cap > 0, "tis_cap", f"got {self.tis_cap}; must be > 0")
        require(
            not (isinstance(self.is_mask, IcePopMask) and self.tis != "off"),
            "tis",
            f"got {self.tis!r} with is_mask icepop, which weights each kept token by its ratio already; set tis: off",
        )

    @property
    def corrects(self) -> bool:
        """Whether the policy loss reweights or masks tokens by their mismatch (TIS or a mask): the step then needs
        the sampler's log-probs and carries importance weights; without either the loss is untouched bit for bit."""
        return self.tis != "off" or not isinstance(self.is_mask, NoMismatchMask)
        require(self.overlong_buffer >= 1, "overlong_buffer", f"got {self.overlong_buffer}; must be >= 1")


@dataclass(frozen=True)
class ActivationCodecConfig:
    """The codec at the pipeline boundaries (design §3.2-3.4); the subclass is chosen by `type:`. Each codec registers
    its own section beside its code in twocircuit_jax/fast/codecs/ (`codecs.register_activation`)."""

    default_type = "none"
    # What differs between codecs, declared by each codec's section in its own file: the checks, the fast circuit,
    # the step's aux reductions and the plots read these, never a codec's `type:` name.
    learns_basis: ClassVar[bool] = False  # learns a basis from the activations, which the anchor may own (owns_q)
    summed_aux: ClassVar[tuple] = ()  # hook aux leaves that add up over rows (micro-batches, replicas); others average
    strength: ClassVar[Optional[tuple]] = None  # (field, short label) of the compression strength, for the plots


@register(ActivationCodecConfig, "none")
@dataclass(frozen=True)
class NoActivationCodec(ActivationCodecConfig):
    """No activation codec: every forward is dense."""


@dataclass(frozen=True)
class GradCodecConfig:
    """The data-parallel gradient codec (design §3.5); the subclass is chosen by `type:`."""

    default_type = "none"


@register(GradCodecConfig, "none")
@dataclass(frozen=True)
class NoGradCodec(GradCodecConfig):
    """No gradient codec: XLA's plain data-parallel mean."""


@dataclass(frozen=True)
class FastConfig:
    """The fast circuit (design §3). `codec: {type: none}` with `grad_codec: {type: none}` is the dense trainer, bit
    for bit. Each codec's knobs live in its own section (`codec: {type: prf_mask, p: 0.9}`; a section's name alone,
    `codec: none`, is that type with its defaults). A flat key of earlier configs (`fast.p`, `fast.grad_rank`) is
    refused, naming the key to write instead (`moved`)."""

    moved: ClassVar[dict] = {
        **{k: f"codec.{k}" for k in ("p", "exact_k", "rescale_mode", "antithetic", "p_by_boundary", "prf_impl")},
        **{k: f"codec.{k}" for k in ("rank", "update_cadence", "sync_basis", "bootstrap", "quant_bits")},
        **{k: f"codec.{k}" for k in ("quant_block", "rounding", "subset_k", "seed", "use_kernel", "warm_start")},
        "reortho_eps": "codec.reortho_eps",
        "grad_rank": "grad_codec.rank",
        **{k: f"grad_codec.{k}" for k in ("min_compression_rate", "start_after", "error_feedback")},
        "compress_embeddings": "grad_codec.compress_embeddings",
    }

    codec: ActivationCodecConfig = field(default_factory=NoActivationCodec)
    grad_codec: GradCodecConfig = field(default_factory=NoGradCodec)
    pp_size: int = field(default=8, metadata=doc("logical pipeline stages; boundaries = pp_size - 1"))
    codec_old_logprob: bool = field(
        default=True, metadata=doc("the old-log-prob forward also runs through the activation codec; false = dense")
    )
    codec_reference: bool = field(
        default=True, metadata=doc("the reference-policy forward also runs through the activation codec; false = dense")
    )
    kernel_interpret: bool = field(
        default=False, metadata=doc("run the Pallas kernels in interpret mode (CPU tests; slow)")
    )

    @property
    def codec_type(self) -> str:
        return type_name(ActivationCodecConfig, self.codec)

    @property
    def grad_codec_type(self) -> str:
        return type_name(GradCodecConfig, self.grad_codec)

    def check(self):
        require(self.pp_size >= 1, "pp_size", f"got {self.pp_size}; must be >= 1")


@dataclass(frozen=True)
class TrainConfig:
    # Keys of earlier configs, refused with the key to write instead (config/base.py from_dict): two names one
    # letter apart meant two different things, and the two batch sizes counted prompts under names that read as rows.
    moved: ClassVar[dict] = {
        "micro_batch": "micro_batch_per_device",
        "microbatches": "pipeline_microbatches",
        "train_batch": "prompts_per_step",
        "mini_batch": "prompts_per_update",
    }

    steps: int = field(
        default=10, metadata=doc("GRPO steps (rollout, then ppo_epochs passes of optimizer ticks); 0 = none")
    )
    prompts_per_step: int = field(default=8, metadata=doc("prompts per GRPO step; each gives sampler.n rollout rows"))
    prompts_per_update: int = field(
        default=8, metadata=doc("prompts per optimizer tick (the mini-batch); must divide prompts_per_step")
    )
    ppo_epochs: int = field(
        default=1, metadata=doc("passes over each step's rollouts, each in prompts_per_step / prompts_per_update ticks")
    )
    eval_every: int = field(
        default=5, metadata=doc("steps between held-out evaluations; 0 = only at start and end (eval section)")
    )
    eval_size: int = field(
        default=64, metadata=doc("held-out problems evaluated: the first N of the task's eval split")
    )
    eval_greedy: bool = field(
        default=True, metadata=doc("held-out evaluation decodes greedily; false = samples at temperature 1")
    )
    seed: int = field(
        default=0,
        metadata=doc("seed of init, problem order, rollout sampling and the env RNG (codecs have their own seed)"),
    )
    checkpoint_every: int = field(
        default=50,
        metadata=doc(
            "steps between periodic checkpoints (a crash loses at most this many steps; SIGTERM/SIGINT also save "
            "one at the next step boundary); 0 = none"
        ),
    )
    final_checkpoint: bool = field(default=True, metadata=doc("checkpoint after the last step"))
    preempt_grace_s: float = field(
        default=0.0,
        metadata=doc(
            "seconds a SIGTERM/SIGINT may wait for the step boundary's checkpoint; past them the run exits 143 "
            "saving nothing (a half-done step is not a consistent state) and names the checkpoint to resume from. "
            "0 = wait for the boundary however long the step takes"
        ),
    )
    compile_cache: str = field(
        default="~/.cache/twocircuit_jax/xla",
        metadata=doc(
            "folder of JAX's persistent compilation cache: a later run of the same shapes loads its programs "
            "instead of compiling them; '' = off. JAX_COMPILATION_CACHE_DIR, when set, wins"
        ),
    )
    probe_every: int = field(default=0, metadata=doc("steps between dense probes (kl/ref_dense, kl/gain); 0 = off"))
    max_prompt_len: int = field(default=32, metadata=doc("prompt length cap in tokens; a longer prompt is an error"))
    skip_nonfinite: bool = field(
        default=True,
        metadata=doc(
            "a tick with a non-finite gradient norm leaves weights and optimizer unchanged; false = applied anyway"
        ),
    )
    pipeline_microbatches: int = field(
        default=0,
        metadata=doc("pipeline microbatches per forward (mesh.stage > 1); 0 = mesh.stage", "M"),
    )
    micro_batch_per_device: int = field(
        default=0,
        metadata=doc(
            "rows per device in one forward/backward: the train step accumulates the mini-batch's gradient over "
            "micro-batches of this size (and forward-only passes run in them); must divide prompts_per_update*sampler.n / "
            "data-parallel size; not with mesh.stage > 1; 0 = the whole mini-batch at once"
        ),
    )
    fused_old_pass: bool = field(
        default=True,
        metadata=doc(
            "a step of one tick takes ℓ_old from the tick's own forward (one forward fewer; step/programs.py "
            "fuses_old_pass says where it applies); false = a separate ℓ_old pass, the reference path (the same "
            "metrics to float round-off)"
        ),
    )
    async_rollouts: int = field(
        default=0,
        metadata=doc(
            "1 = the sampler generates step t+1's rollouts, from the weights step t's came from, while the trainer "
            "updates on step t (each rollout one weight version stale: sampler/staleness; grpo.tis corrects it); "
            "0 = generate, then train"
        ),
    )

    def check(self):
        require(self.steps >= 0, "steps", f"got {self.steps}; must be >= 0")
        require(self.prompts_per_step >= 1, "prompts_per_step", f"got {self.prompts_per_step}; must be >= 1")
        require(
            1 <= self.prompts_per_update <= self.prompts_per_step
            and self.prompts_per_step % self.prompts_per_update == 0,
            "prompts_per_update",
            f"got {self.prompts_per_update}; must divide prompts_per_step={self.prompts_per_step}",
        )
        require(self.eval_every >= 0, "eval_every", f"got {self.eval_every}; must be >= 0 (0 = only at the ends)")
        require(self.checkpoint_every >= 0, "checkpoint_every", f"got {self.checkpoint_every}; must be >= 0")
        require(
            self.preempt_grace_s >= 0, "preempt_grace_s", f"got {self.preempt_grace_s}; must be >= 0 (0 = no limit)"
        )
        require(
            self.pipeline_microbatches >= 0,
            "pipeline_microbatches",
            f"got {self.pipeline_microbatches}; must be >= 0 (0 = mesh.stage)",
        )
        require(
            self.micro_batch_per_device >= 0,
            "micro_batch_per_device",
            f"got {self.micro_batch_per_device}; must be >= 0 (0 = the whole mini-batch)",
        )
        require(self.async_rollouts in (0, 1), "async_rollouts", f"got {self.async_rollouts}; allowed 0 or 1")


@dataclass(frozen=True)
class EvalConfig:
    """When the held-out evaluation runs besides every `train.eval_every` steps."""

    at_start: bool = field(default=True, metadata=doc("evaluate the base model before step 1 (logged as step 0)"))
    at_end: bool = field(default=True, metadata=doc("evaluate after the last step"))


@dataclass(frozen=True)
class TaskConfig:
    """A verifiable-reward task; the subclass is chosen by `type:`."""

    default_type = "reasoning_gym"
    prompt_template: str = field(
        default="{question}=",
        metadata=doc("prompt text; {question} is filled in (reasoning_gym also has {full_question})"),
    )
    answer_suffix: str = field(
        default="",
        metadata=doc(
            "appended to the reference solution in SFT targets; reasoning_gym cuts the answer there ('' = newline)"
        ),
    )
    # On by default: the bound runs the scoring in one long-lived worker process (tasks/bounded.py), forked once per
    # task; measured on the demo (256 rows a step) it adds ~1 ms of the trainer's CPU and ~1.5 ms of the worker's to
    # a step (<1%). 300 s: a python task's function scores a whole step in one call (an LLM judge over every row
    # may take minutes), and a built-in verifier row takes milliseconds, so only a hung call ever reaches it.
    # The worker's own memory grows towards the trainer's host RSS at the fork (copy-on-write), see tasks/bounded.py.
    reward_timeout_s: float = field(
        default=300.0,
        metadata=doc(
            "seconds one scoring call (a row; a python task's function call) may take; a slower one is stopped and "
            "counts as a failed score (reward 0, reward/score_errors, reward/timeouts); 0 = no bound (scoring runs "
            "in the trainer's process). Bounded calls run in a worker process forked once: a scorer's module-level "
            "state (caches, counters, a loaded model) lives there between calls, unseen by the trainer, and starts "
            "afresh after a timeout"
        ),
    )

    def check(self):
        require(self.reward_timeout_s >= 0, "reward_timeout_s", f"got {self.reward_timeout_s}; must be >= 0 (0 = none)")


@register(TaskConfig, "reasoning_gym")
@dataclass(frozen=True)
class ReasoningGymTask(TaskConfig):
    """Procedural problems from the reasoning-gym package, scored by its own scoring."""

    dataset: str = field(default="basic_arithmetic", metadata=doc("reasoning-gym dataset name"))
    options: dict = field(
        default_factory=dict,
        metadata=doc("keyword arguments of the dataset, over the built-in demo options key by key"),
    )
    question: str = field(
        default="",
        metadata=doc("template over the entry's metadata for a compact question, e.g. 'gcd{numbers}'; '' = expression"),
    )
    train_seed: int = field(default=1, metadata=doc("seed of the generated training problems"))
    eval_seed: int = field(default=2, metadata=doc("seed of the generated held-out problems"))
    train_size: int = field(default=2000, metadata=doc("training problems generated (>= 1)"))
    eval_size: int = field(
        default=200, metadata=doc("held-out problems wanted; repeats of training problems are dropped")
    )


@register(TaskConfig, "math_files")
@dataclass(frozen=True)
class MathFilesTask(TaskConfig):
    """MATH-style problems from local JSONL or Parquet files; the final \\boxed{} answer is graded by math-verify."""

    train_files: tuple[str, ...] = field(
        default=(), metadata=doc("local .jsonl or .parquet files of training problems (at least one)")
    )
    eval_files: tuple[str, ...] = field(default=(), metadata=doc("held-out problem files; () = no evaluation"))
    problem_key: str = field(default="problem", metadata=doc("the rows' question field"))
    answer_key: str = field(
        default="answer", metadata=doc("the rows' reference answer field; missing = the solution's last \\boxed{}")
    )
    solution_key: str = field(
        default="solution", metadata=doc("the rows' worked solution field, used as the SFT target")
    )

    def check(self):
        super().check()
        require(len(self.train_files) > 0, "train_files", "at least one local .jsonl or .parquet file is required")


@register(TaskConfig, "python")
@dataclass(frozen=True)
class PythonTask(TaskConfig):
    """One's own reward functions on one's own rows (tasks/python_task.py). From Python, pass them to
    `twocircuit_jax.GRPOTrainer(cfg, reward_fns=[...], train_dataset=..., eval_dataset=...)` instead."""

    prompt_template: str = field(
        default="{prompt}", metadata=doc("the prompt text; {prompt} and any text field of the row are filled in")
    )
    reward_fns: tuple[str, ...] = field(
        default=(), metadata=doc("module:function or file.py:function, (prompts, completions, **fields) -> floats")
    )
    reward_weights: tuple[float, ...] = field(default=(), metadata=doc("one per reward function; () = all 1"))
    train_files: tuple[str, ...] = field(default=(), metadata=doc("local .jsonl or .parquet rows"))
    eval_files: tuple[str, ...] = field(default=(), metadata=doc("held-out rows; () = no evaluation"))
    prompt_key: str = field(default="prompt", metadata=doc("the rows' prompt field"))
    max_reward_failure_frac: float = field(
        default=0.5, metadata=doc("stop the run when more of a step's (row, function) reward calls raise")
    )

    def check(self):
        super().check()
        require(
            self.answer_suffix == "",
            "answer_suffix",
            f"got {self.answer_suffix!r}; the python task has no reference solutions to end (its rewards judge the "
            "completion), so only '' is allowed",
        )
        require(
            0 <= self.max_reward_failure_frac <= 1,
            "max_reward_failure_frac",
            f"got {self.max_reward_failure_frac}; allowed [0, 1]",
        )
        if self.reward_weights:
            require(
                len(self.reward_weights) == len(self.reward_fns),
                "reward_weights",
                f"got {len(self.reward_weights)} weights for {len(self.reward_fns)} reward_fns",
            )


@dataclass(frozen=True)
class SFTConfig:
    """Supervised training of the tiny base model on task solutions."""

    steps: int = field(default=300, metadata=doc("SFT optimizer steps"))
    batch: int = field(default=64, metadata=doc("examples per SFT step, drawn with replacement"))
    lr: float = field(default=3e-3, metadata=doc("peak SFT learning rate (warm-up, then cosine to a tenth)"))
    warmup_steps: int = field(default=20, metadata=doc("linear warm-up of the SFT learning rate, in steps"))
    max_len: int = field(
        default=48,
        metadata=doc("SFT example length in tokens (prompt + solution, cut to fit); a longer prompt is an error"),
    )
    eval_every: int = field(
        default=100, metadata=doc("SFT steps between held-out evaluations; 0 = only after the last")
    )
