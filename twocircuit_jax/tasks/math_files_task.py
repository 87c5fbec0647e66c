"""MATH-style problems from local JSONL or Parquet files; the last `\\boxed{...}` of a completion is graded by
math-verify against the reference answer (the `answer_key` field, else the last `\\boxed{}` of the solution).

Malformed input raises `DataError` naming the file, the line (JSONL) or row (Parquet), and the field.
No `eval_files` means no held-out split: `eval_problems()` is empty.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Iterator, Optional

from twocircuit_jax.tasks.base import DataError, Problem, ScoreResult, render_template

_BOXES = ("\\boxed", "\\fbox")


def last_boxed(text: str) -> Optional[str]:
    """Content of the last `\\boxed{...}` (nested braces, escaped `\\{ \\}` inside) or `\\boxed 5`; None if absent
    or unbalanced."""
    if not isinstance(text, str):
        return None
    start = max(text.rfind(b) for b in _BOXES)
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    if i < len(text) and text[i] == " ":  # `\boxed 5`: up to the next space or `$`
        rest = text[i + 1 :]
        end = min([k for k in (rest.find(" "), rest.find("$")) if k >= 0], default=len(rest))
        return rest[:end].strip() or None
    if i >= len(text) or text[i] != "{":
        return None
    depth, j = 0, i
    while j < len(text):
        c = text[j]
        if c == "\\":  # an escaped character (\{ \} \\) never opens or closes the box
            j += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
        j += 1
    return None


def read_records(path) -> Iterator[tuple[str, dict]]:
    """(where, record) pairs of one local .jsonl/.json (JSON lines) or .parquet file; `where` is 'file:line N' or
    'file:row N' for error messages."""
    return _records(Path(path).expanduser())


def _records(path: Path) -> Iterator[tuple[str, dict]]:
    """(where, record) pairs; `where` is 'file:line N' or 'file:row N' for error messages."""
    if not path.is_file():
        raise DataError(
            f"{path}: file not found (task.train_files / task.eval_files take local .jsonl or .parquet files)"
        )
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:line {n}: invalid JSON ({e.msg} at column {e.colno})") from e
                if not isinstance(rec, dict):
                    raise DataError(f"{path}:line {n}: expected a JSON object, got {type(rec).__name__}")
                yield f"{path}:line {n}", rec
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises ArrowInvalid / OSError for non-parquet bytes
            raise DataError(f"{path}: cannot read as Parquet: {e}") from e
        for n, rec in enumerate(rows, 1):
            yield f"{path}:row {n}", rec
    else:
        raise DataError(f"{path}: unsupported extension {suffix!r}; allowed .jsonl, .json (JSON lines), .parquet")


def _text(rec: dict, key: str, where: str, required: bool) -> Optional[str]:
    v = rec.get(key)
    if v is None or (isinstance(v, str) and not v.strip()):
        if required:
            raise DataError(f"{where}: field {key!r} is missing or empty (present: {sorted(rec)})")
        return None
    if isinstance(v, bool) or not isinstance(v, (str, int, float)):
        raise DataError(f"{where}: field {key!r} must be a string or number, got {type(v).__name__}")
    return str(v)


def load_problems(files, cfg, split: str) -> list[Problem]:
    out = []
    for file in files:
        path = Path(file).expanduser()
        for where, rec in _records(path):
            question = _text(rec, cfg.problem_key, where, required=True)
            solution = _text(rec, cfg.solution_key, where, required=False)
            answer = _text(rec, cfg.answer_key, where, required=False)
            if answer is None:
                answer = last_boxed(solution) if solution else None
            if answer is None:
                raise DataError(
                    f"{where}: no reference answer: field {cfg.answer_key!r} is missing and field "
                    f"{cfg.solution_key!r} has no \\boxed{{...}}"
                )
            out.append(
                Problem(
                    id=where.replace(":line ", ":").replace(":row ", ":"),
                    question=question,
                    answer=answer,
                    solution=solution if solution else f"\\boxed{{{answer}}}",
                    meta={"source": str(path), "split": split},
                )
            )
    return out


def _timeout(seconds: int) -> Optional[int]:
    # math-verify's timeout installs a SIGALRM handler, which python allows only on the main thread.
    return seconds if threading.current_thread() is threading.main_thread() else None


def _parse(latex: str):
    from math_verify import parse

    return parse(f"${latex}$", parsing_timeout=_timeout(5))


class MathFilesTask:
    def __init__(self, cfg):
        self.cfg = cfg
        self._train: Optional[list[Problem]] = None
        self._eval: Optional[list[Problem]] = None
        self._gold: dict[str, list] = {}  # answer string -> parsed gold (parsing is the slow part)

    def train_problems(self) -> list[Problem]:
        if self._train is None:
            self._train = load_problems(self.cfg.train_files, self.cfg, "train")
            if not self._train:
                raise DataError(f"task.train_files {list(self.cfg.train_files)}: no problems found")
        return self._train

    def eval_problems(self) -> list[Problem]:
        if self._eval is None:
            self._eval = load_problems(self.cfg.eval_files, self.cfg, "eval")
        return self._eval

    def prompt(self, problem: Problem) -> str:
        return render_template(self.cfg.prompt_template, question=problem.question)

    def reference_completion(self, problem: Problem) -> str:
        return problem.solution + self.cfg.answer_suffix

    def score(self, problem: Problem, completion_text: str) -> ScoreResult:
        from math_verify import verify

        pred_text = last_boxed(completion_text)
        if pred_text is None:
            return ScoreResult(0.0, False, None)
        pred = _parse(pred_text)
        if not pred:
            return ScoreResult(0.0, False, None)
        if problem.answer not in self._gold:
            self._gold[problem.answer] = _parse(problem.answer)
        gold = self._gold[problem.answer]
        if not gold:  # reference math-verify cannot read: fall back to exact text
            ok = "".join(pred_text.split()) == "".join(problem.answer.split())
        else:
            ok = verify(gold, pred, timeout_seconds=_timeout(5))
        return ScoreResult(1.0 if ok else 0.0, True, None)
