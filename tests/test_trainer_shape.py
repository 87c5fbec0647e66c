"""The trainer stays one that a reader can hold in mind: train/loop.py orchestrates a built run (train/built_run.py)
in at most 300 lines, and GRPOTrainer keeps at most 20 instance attributes, the loop state that changes (read from
the source: every distinct `self.X` assigned in the class and in its mixin, train/trainer_checkpoints.py)."""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest

TRAIN = pathlib.Path(__file__).resolve().parents[1] / "twocircuit_jax" / "train"
MAX_LINES, MAX_ATTRIBUTES = 300, 20


def self_attributes(source: str, cls: str) -> set[str]:
    """Distinct `self.X` targets of assignments (plain, tuple, augmented, annotated) inside class `cls`."""
    (node,) = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == cls]
    out = set()
    for n in ast.walk(node):
        targets = (
            n.targets
            if isinstance(n, ast.Assign)
            else [n.target]
            if isinstance(n, (ast.AugAssign, ast.AnnAssign))
            else []
        )
        stack = list(targets)
        while stack:
            t = stack.pop()
            if isinstance(t, (ast.Tuple, ast.List)):
                stack.extend(t.elts)
            elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                out.add(t.attr)
    return out


def trainer_attributes() -> set[str]:
    return self_attributes((TRAIN / "loop.py").read_text(), "GRPOTrainer") | self_attributes(
        (TRAIN / "trainer_checkpoints.py").read_text(), "TrainerCheckpoints"
    )


def test_loop_is_at_most_300_lines():
    n = len((TRAIN / "loop.py").read_text().splitlines())
    assert n <= MAX_LINES, f"train/loop.py has {n} lines; move a phase to train/step_phases.py or built_run.py"


def test_trainer_has_at_most_20_instance_attributes():
    attrs = trainer_attributes()
    assert len(attrs) <= MAX_ATTRIBUTES, sorted(attrs)
    assert {"built", "state", "cs", "gs"} <= attrs  # the count reads the real class (it can fail)


def test_the_attribute_count_sees_every_kind_of_assignment():
    body = ["self.a = 1", "self.b, (self.c, x) = 2, (3, 4)", "self.d += 1", "self.e: int = 5", "other.z = 6"]
    src = "class C:\n def f(self):\n" + "".join(f"  {line}\n" for line in body)
    assert self_attributes(src, "C") == {"a", "b", "c", "d", "e"}


def test_built_run_is_frozen_and_its_parts_read_only_on_the_trainer():
    from twocircuit_jax.step.programs import Programs
    from twocircuit_jax.train.built_run import BuiltRun
    from twocircuit_jax.train.loop import GRPOTrainer

    assert BuiltRun.__dataclass_params__.frozen
    for f in dataclasses.fields(BuiltRun):
        assert getattr(GRPOTrainer, f.name).fset is None, f.name  # a different run is a new BuiltRun
    for name in Programs._fields:  # swappable for instrumentation, through a new BuiltRun
        assert getattr(GRPOTrainer, name).fset is not None, name
    with pytest.raises(dataclasses.FrozenInstanceError):
        object.__new__(BuiltRun).cfg = None
