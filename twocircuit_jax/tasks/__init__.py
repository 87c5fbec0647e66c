"""Verifiable-reward tasks (reasoning-gym, MATH files) and reward shaping."""

from __future__ import annotations

from twocircuit_jax.tasks.base import DataError, Problem, ScoreResult, Task


def make_task(task_cfg) -> Task:
    """The task for a TaskConfig subclass (chosen in YAML by `task.type`). A section registered elsewhere (a test, a
    user module) brings its task with a `build()` method."""
    build = getattr(task_cfg, "build", None)
    if build is not None:
        return build()
    from twocircuit_jax.config.sections import (
        MathFilesTask as MathCfg,
        PythonTask as PyCfg,
        ReasoningGymTask as RGCfg,
    )

    if isinstance(task_cfg, RGCfg):
        from twocircuit_jax.tasks.reasoning_gym_task import ReasoningGymTask

        return ReasoningGymTask(task_cfg)
    if isinstance(task_cfg, MathCfg):
        from twocircuit_jax.tasks.math_files_task import MathFilesTask

        return MathFilesTask(task_cfg)
    if isinstance(task_cfg, PyCfg):
        from twocircuit_jax.tasks.python_task import PythonTask

        return PythonTask.from_config(task_cfg)
    raise ValueError(
        f"task: no task implementation for config {type(task_cfg).__name__}; "
        f"allowed task.type: reasoning_gym, math_files, python, or a section with a build() method"
    )


__all__ = ["DataError", "Problem", "ScoreResult", "Task", "make_task"]
