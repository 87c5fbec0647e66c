"""What `GRPOTrainer(config, reward_fns=..., train_dataset=...)` accepts, turned into a run config and a task."""

from __future__ import annotations

import dataclasses
import os

from twocircuit_jax.config.base import ConfigError


def as_config(cfg):
    """A RunConfig from a RunConfig, a dict of sections or a YAML path."""
    from twocircuit_jax.config.run import RunConfig, load_config

    if isinstance(cfg, RunConfig):
        return cfg
    if isinstance(cfg, dict):
        return load_config(data=cfg)
    if isinstance(cfg, (str, os.PathLike)):
        return load_config(os.fspath(cfg))
    raise TypeError(f"config: got {type(cfg).__name__}; expected a RunConfig, a dict of sections or a YAML path")


def python_task(cfg, reward_fns, reward_weights, train_dataset, eval_dataset):
    """(config, task) for reward functions and rows given as Python objects; the config's task becomes
    `type: python` (allowed when it is one already or left at the default), naming the functions it was given."""
    from twocircuit_jax.config.base import from_dict
    from twocircuit_jax.config.sections import PythonTask as PyCfg, TaskConfig
    from twocircuit_jax.tasks.python_task import PythonTask, load_function, reward_fns as named_fns

    if cfg.env.enabled:
        raise ConfigError("env.type", "reward_fns / train_dataset train a single-turn task; set env.type: none")
    tc = cfg.task
    if not isinstance(tc, PyCfg):
        if tc != from_dict(TaskConfig, {}):
            raise ConfigError(
                "task.type",
                f"got {type(tc).__name__}; reward_fns / train_dataset need task.type: python (or no task section)",
            )
        tc = PyCfg()
    if reward_fns is None:
        if not tc.reward_fns:
            raise ConfigError("reward_fns", "no reward functions: pass reward_fns=[...] or set task.reward_fns")
        reward_fns = [load_function(s, f"task.reward_fns[{i}]") for i, s in enumerate(tc.reward_fns)]
    weights = tc.reward_weights if reward_weights is None else tuple(float(w) for w in reward_weights)
    fns = named_fns(reward_fns, weights)
    if train_dataset is None:
        if not tc.train_files:
            raise ConfigError("train_dataset", "no training rows: pass train_dataset=... or set task.train_files")
        from twocircuit_jax.tasks.math_files_task import read_records

        train_dataset = [r for f in tc.train_files for _, r in read_records(f)]
    if eval_dataset is None and tc.eval_files:
        from twocircuit_jax.tasks.math_files_task import read_records

        eval_dataset = [r for f in tc.eval_files for _, r in read_records(f)]
    # The saved config names the functions (module:qualname) and weights it ran with; a record, since a function
    # defined in a script or notebook cannot be imported back.
    names = tuple(f"{getattr(f.fn, '__module__', '?')}:{getattr(f.fn, '__qualname__', f.name)}" for f in fns)
    tc = dataclasses.replace(tc, reward_fns=names, reward_weights=tuple(f.weight for f in fns))
    cfg = dataclasses.replace(cfg, task=tc)
    return cfg, PythonTask(tc, fns, train_dataset, eval_dataset)
