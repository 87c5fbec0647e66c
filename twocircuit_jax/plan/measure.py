"""What the compiler says about one program: per-device memory, cost, collective bytes, and its largest buffers.

Everything is per device and per call, read from the compiled (SPMD-partitioned) program: XLA's memory analysis
(argument, output, temporary and aliased bytes), its cost analysis (flops, bytes accessed), the collectives of
its HLO text (fast/hlo_bytes.py: by part, each times its loop's trip count; fast/bytes.py: by kind), and the
biggest instructions of the text by result size, so a plan that does not fit names what to shrink.
"""

from __future__ import annotations

import math
import re

import jax

from twocircuit_jax.fast.bytes import COLLECTIVE_KINDS, collective_bytes_from_hlo, shape_bytes
from twocircuit_jax.fast.hlo_bytes import (
    INSTR,
    OP_NAME,
    PARTS,
    computations,
    memory_bytes,
    staged_bytes,
    with_derived_trips,
)

# Results that are no buffer of their own (views, tuples of other buffers, the inputs themselves); a while/call/
# conditional returns its body's buffers, which are listed where the body makes them.
_NOT_BUFFERS = {"parameter", "tuple", "get-tuple-element", "bitcast", "constant", "after-all", "copy-done"}
_NOT_BUFFERS |= {"while", "call", "conditional"}
_FUSION_CALLEE = re.compile(r"\bcalls=%?([\w.\-]+)")


def lower_program(jitted, args, platform: str):
    """Lower from the ShapeDtypeStruct `args`. For TPU the plain jax.jit (dispatch.Jitted's `wrapped`): the CPU
    compile options the wrapper adds on a CPU host are no TPU options."""
    fn = getattr(jitted, "wrapped", jitted) if platform != "cpu" else jitted
    return fn.lower(*args)


def leaf_bytes(x, sharding, replicas: int) -> float:
    """Per-device bytes of one ShapeDtypeStruct under `sharding`. No sharding: an input the program never reads (jit
    prunes it) but the caller still holds; it counts as a batch row array, its leading axis split over the
    `replicas` data-parallel devices (parallel/mesh.py batch_shardings)."""
    if sharding is not None:
        n = math.prod(sharding.shard_shape(x.shape))
    else:
        n = math.prod(x.shape) // (replicas if x.ndim else 1)
    return float(n * x.dtype.itemsize)


def arg_leaf_bytes(lowered, args, replicas: int) -> list:
    """[[per-device bytes of each leaf] for each top-level argument], under the shardings the program was lowered
    with: known before (and without) a successful compile. Read from the lowering's compile arguments (jax 0.10, a
    private field; the version is pinned): one sharding per kept flat input, `kept_var_idx` naming them."""
    ca = lowered._lowering.compile_args
    flat_args = jax.tree.leaves(args)
    flat = [None] * len(flat_args)
    for i, sh in zip(sorted(ca["kept_var_idx"]), ca["in_shardings"]):
        flat[i] = sh
    out, at = [], 0
    for a in args:
        n = len(jax.tree.leaves(a))
        out.append([leaf_bytes(x, sh, replicas) for x, sh in zip(flat_args[at : at + n], flat[at : at + n])])
        at += n
    return out


_ELEMENT = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\](\{[^}]*\})?")
_SPACE = re.compile(r"S\((\d+)\)")


def _buffer_bytes(shape: str, first_only: bool = False) -> tuple:
    """(bytes, memory spaces) of the array(s) in an HLO result shape. TPU layouts mark memory other than HBM with
    S(k), k > 0 (S(1): the core's on-chip VMEM): such buffers are reported with their space, since the memory
    analysis's temporaries count them too. A copy-start's tuple is (destination, source, context): only the
    destination is new."""
    total, spaces = 0.0, set()
    for i, (dt, dims, layout) in enumerate(_ELEMENT.findall(shape)):
        if first_only and i > 0:
            break
        sp = _SPACE.search(layout or "")
        spaces.add("hbm" if not sp or sp.group(1) == "0" else f"S({sp.group(1)})")
        total += shape_bytes(f"{dt}[{dims}]")
    return total, ",".join(sorted(spaces))


def largest_buffers(hlo_text: str, k: int = 5) -> list:
    """The `k` biggest instruction results of the compiled program, outside fusion bodies (what a fusion computes
    inside stays in registers/VMEM; its result is the buffer): [{name, op, shape, bytes, space, source}], source
    being the jax operation that made it (op_name metadata)."""
    comps, _ = computations(hlo_text)
    fused = set()
    for lines in comps.values():
        for line in lines:
            if " fusion(" in line:
                fused.update(_FUSION_CALLEE.findall(line))
    rows = []
    for cname, lines in comps.items():
        if cname in fused:
            continue
        for line in lines:
            m = INSTR.match(line)
            if not m or m.group(3) in _NOT_BUFFERS:
                continue
            b, space = _buffer_bytes(m.group(2), first_only=m.group(3) == "copy-start")
            if b:
                src = (OP_NAME.search(line) or [None, ""])[1]
                shape = re.sub(r"\{[^}]*\}", "", m.group(2))  # dtype[dims] without the layouts
                rows.append(
                    {"name": m.group(1), "op": m.group(3), "shape": shape, "bytes": b, "space": space, "source": src}
                )
    rows.sort(key=lambda r: -r["bytes"])
    return rows[:k]


def _cost(compiled) -> dict:
    c = compiled.cost_analysis()
    if isinstance(c, (list, tuple)):  # older jax: one dict per program
        c = c[0] if c else {}
    c = c or {}
    return {"flops": float(c.get("flops", 0.0)), "bytes_accessed": float(c.get("bytes accessed", 0.0))}


def _with_trips(hlo_text: str, n: int) -> str:
    """The text with `n` as the trip count of every while loop whose count neither XLA recorded nor its shape gives
    (fast/hlo_bytes.py `with_derived_trips` has written the others), so fast/hlo_bytes.py can walk it."""
    out = []
    for line in hlo_text.splitlines():
        if " while(" in line and "known_trip_count" not in line:
            line += f' backend_config={{"known_trip_count":{{"n":"{n}"}}}}'
        out.append(line)
    return "\n".join(out)


def collectives(hlo_text: str, replicas: int, islands=None) -> tuple:
    """({part: bytes per data replica per call}, note, {part: those bytes that cross the slow link}). TPU's compiled
    text records no trip counts; a loop of the usual shape (`i < N`, `i += step`, `i` from a constant: every
    lax.scan and fori_loop) has its count read from its text. A loop still without one is walked twice, at 1 and
    at 2 trips: equal results mean no collective sits in it and the count is exact; otherwise its collectives are
    counted once and the note says so (a lower bound).
    `islands`: the island of each device id (parallel/mesh.py islands), None when there is one."""
    hlo_text, _ = with_derived_trips(hlo_text)
    parts, slow = {}, {}
    for n in (1, 2):
        got = staged_bytes(_with_trips(hlo_text, n), replicas, islands)
        parts[n] = {p: got[p] for p in PARTS}
        slow[n] = dict(got["slow"])
    note = "" if parts[1] == parts[2] else "collectives in loops of unknown trip count counted once (a lower bound)"
    return parts[1], note, slow[1]


_OOM_TOTAL = re.compile(r"required for HLO temporaries \(([\d.]+)([KMGTP]?)\)")
_OOM_ALLOC = re.compile(r"Allocation \(size=(\d+)\).*?\[shape: (\w+\[[\d,]*\]).*::\s*([\w.\-]+)", re.S)
_UNIT = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50}


def _oom_total(message: str) -> float:
    """The compiler's total of temporaries in its out-of-memory message (`HLO temporaries (4.69T)`, binary units)."""
    m = _OOM_TOTAL.search(message)
    if m is None:
        raise RuntimeError(f"the compiler failed without a memory total: {message[:500]}")
    return float(m.group(1)) * _UNIT[m.group(2)]


def oom_allocation(lowered) -> list:
    """For a program the TPU compiler refused: a second compile told not to stop at the first allocation past the
    limit (`xla_tpu_no_crash_on_oom`) names that allocation (shape and instruction), the buffer to shrink first.
    When its message names none, the message itself (what the compiler said) is the one entry. As slow as the first
    compile: the plan asks it for the peak program only."""
    try:
        lowered.compile(compiler_options={"xla_tpu_no_crash_on_oom": True})
    except jax.errors.JaxRuntimeError as e:  # expected: the same program, still past the limit
        a = _OOM_ALLOC.search(str(e))
        if a:
            src = "first allocation past the HBM limit (xla_tpu_no_crash_on_oom)"
            return [{"name": a.group(3), "op": "allocation", "shape": a.group(2), "bytes": float(a.group(1)),
                     "space": "hbm", "source": src}]  # fmt: skip
        msg = " ".join(str(e).split())[:400]
        return [{"name": "", "op": "compiler", "shape": "", "bytes": 0.0, "space": "hbm", "source": msg}]
    return []


def measure(jitted, args, platform: str, replicas: int, islands=None) -> dict:
    """Compile one program and read everything the plan reports about it (per device, per call). A TPU program
    past the chip's HBM does not compile: then memory holds the compiler's required temporaries only, `oom` its
    message, `lowered` the lowering (for `oom_allocation`), and cost and collectives are None."""
    lowered = lower_program(jitted, args, platform)
    leaves = arg_leaf_bytes(lowered, args, replicas)
    base = {"args": [sum(x) for x in leaves], "arg_leaves": leaves, "oom": ""}
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        mem = {"argument": sum(base["args"]), "output": None, "temp": _oom_total(str(e)), "alias": None}
        return {**base, "memory": mem, "cost": None, "collectives": None, "collective_bytes": None, "slow_bytes": None,
                "collective_kinds": None, "largest": [], "note": "", "oom": str(e).splitlines()[0],
                "lowered": lowered}  # fmt: skip
    hlo = compiled.as_text()
    kinds = collective_bytes_from_hlo(hlo)
    coll, note, slow = collectives(hlo, replicas, islands)
    return {
        **base,
        "memory": memory_bytes(compiled),
        "cost": _cost(compiled),
        "collectives": coll,
        "collective_bytes": float(sum(coll.values())),
        "slow_bytes": float(sum(slow.values())),
        "collective_kinds": {k: kinds[k] for k in COLLECTIVE_KINDS if kinds[k]},
        "largest": largest_buffers(hlo),
        "note": note,
    }
