"""Tool-use arithmetic: the policy may call a calculator before it answers.

Actions: `c:EXPR` evaluates EXPR (digits, + - * and parentheses) and observes `=VALUE;`; `a:NUMBER` answers, which
ends the trajectory with reward 1 when NUMBER is the problem's value, else 0. Anything else is a format error.
A policy that answers at once must do the arithmetic itself; one that calls the tool first only copies the value.
"""

from __future__ import annotations

import ast
import operator

import numpy as np

from twocircuit_jax.envs.base import EnvFamily, StepResult, parse_int
from twocircuit_jax.tasks.base import Problem

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_ALLOWED = set("0123456789+-*() ")


def evaluate(expr: str):
    """The integer value of an arithmetic expression over + - * and parentheses, or None (bad syntax, too big)."""
    if not expr or not set(expr) <= _ALLOWED or len(expr) > 64:
        return None
    try:
        tree = ast.parse(expr, mode="eval").body
    except SyntaxError:
        return None

    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError("unsupported")

    try:
        v = ev(tree)
    except ValueError:
        return None
    return v if abs(v) < 10**9 else None


class Calculator:
    def __init__(self, rng: np.random.Generator):
        self.rng = rng

    def reset(self, problem: Problem) -> str:
        self.expr, self.value, self.called = problem.question.rstrip("?"), int(problem.answer), False
        return problem.question

    def step(self, action_text: str) -> StepResult:
        a = action_text.strip()
        if a.startswith("c:"):
            v = evaluate(a[2:])
            if v is None:
                return StepResult("!", 0.0, True, {"format_ok": False, "success": False})
            self.called = True
            return StepResult(f"={v};", 0.0, False, {"format_ok": True, "tool_call": True})
        if a.startswith("a:") and parse_int(a[2:]) is not None:
            ok = parse_int(a[2:]) == self.value
            return StepResult("", 1.0 if ok else 0.0, True, {"format_ok": True, "success": ok})
        return StepResult("!", 0.0, True, {"format_ok": False, "success": False})

    def expert_action(self, rng: np.random.Generator, noise: float) -> str:
        if self.called:
            return f"a:{self.value}"
        if rng.random() < noise:  # answers without the tool: a near miss more often than not
            return f"a:{self.value + int(rng.integers(-2, 3))}"
        return f"c:{self.expr}"


class CalculatorFamily(EnvFamily):
    name = "calculator"

    def generate(self, n: int, seed: int, split: str) -> list[Problem]:
        c = self.cfg
        rng = np.random.default_rng(seed)
        out = []
        for i in range(n):
            k = int(rng.integers(c.min_terms, c.max_terms + 1))
            nums = [str(int(rng.integers(1, c.max_operand + 1))) for _ in range(k)]
            ops = [c.ops[int(rng.integers(len(c.ops)))] for _ in range(k - 1)]
            expr = nums[0] + "".join(o + x for o, x in zip(ops, nums[1:]))
            v = evaluate(expr)
            out.append(Problem(f"calculator/{split}/{i}", f"{expr}?", str(v), str(v), {}))
        return out

    def make(self, rng: np.random.Generator) -> Calculator:
        return Calculator(rng)
