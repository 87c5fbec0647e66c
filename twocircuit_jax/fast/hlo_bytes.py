"""Bytes per collective of a compiled program with real pipeline stages, split by what they carry.

`staged_bytes(hlo_text)` reads the compiled (SPMD-partitioned) HLO text of a step that uses parallel/pipeline.py:
  boundary_fwd   collective-permutes under the pipeline's `stage_boundary` scope (forward messages)
  boundary_bwd   their transposes (op name with "transpose("): the backward messages
  stage_exit     the last stage's per-token log-probs and entropies and the boundary aux summed over `stage`
                 (forward and backward)
  grad_reduce    every other collective: the gradient sums (layers over `data`, end weights over `stage` and
                 `data`) and the loss's scalar reductions
Each instruction counts its result bytes (one device's message) times how often it runs: a collective inside a
`while` body (the pipeline's tick loop) runs `known_trip_count` times per call of the loop, which XLA records in
the loop's backend config; a loop without one is an error rather than a guess. A collective-permute counts once per
source-target pair per data replica (`pairs / replicas`), so all numbers are per data replica.

Slow link (`islands`: the island of each device id, parallel/mesh.py islands): a collective whose replica groups
hold devices of more than one island crosses the slow link, and its bytes count there too ("slow"); a
collective-permute counts there the share of its source-target pairs that join two islands. The ids of a compiled
SPMD program's groups are its partition ids, the positions in the mesh's flat device order. This is the message a
device puts into a group that crosses the link, not the share a hierarchical algorithm would send over it.
The TPU compiler for several slices splits such a collective itself: an ICI collective inside each slice and a
host-transfer `send` to the Megascale (DCN) runtime (`_xla_host_transfer_handler_name="xla_megascale_runtime"`)
between them; each such send counts its payload (the first array of its result) as slow-link bytes, in the part its
op name gives (grad_reduce without one).
"""

from __future__ import annotations

import json
import re

from twocircuit_jax.fast.bytes import COLLECTIVE_KINDS, shape_bytes

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([\w\-]+)\((.*)$")
_CALLEES = re.compile(r"\b(?:body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
OP_NAME = re.compile(r'op_name="([^"]*)"')
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_GROUPS = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")

PARTS = ("boundary_fwd", "boundary_bwd", "stage_exit", "grad_reduce")


def computations(hlo_text: str):
    """{name: [instruction lines]} and the entry computation's name."""
    comps, entry, cur = {}, None, None
    for line in hlo_text.splitlines():
        m = _HEADER.match(line) if line[:1] not in (" ", "\t", "") else None  # instructions are indented
        if m:
            cur = m.group(2)
            comps[cur] = []
            if m.group(1):
                entry = cur
        elif cur is not None and line.strip() == "}":
            cur = None
        elif cur is not None:
            comps[cur].append(line)
    if entry is None:
        raise ValueError("compiled HLO text without an ENTRY computation")
    return comps, entry


_KNOWN_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_WHILE_PARTS = re.compile(r"while\(%?([\w.\-]+)\).*?condition=%?([\w.\-]+), body=%?([\w.\-]+)")
_INDEX = re.compile(r"index=(\d+)")
_PASS_THROUGH = ("copy", "bitcast", "convert", "reshape")


def _operands(rest: str) -> list:
    """The operand names of one instruction: `rest` is the text after its opening parenthesis."""
    depth, end = 1, len(rest)
    for i, ch in enumerate(rest):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            end = i
            break
    return re.findall(r"%([\w.\-]+)", rest[:end])


def _defs(lines: list) -> dict:
    """{instruction name: (op, operands, line)} of one computation."""
    out = {}
    for line in lines:
        m = INSTR.match(line)
        if m:
            out[m.group(1)] = (m.group(3), _operands(m.group(4)), line)
    return out


def _root(lines: list):
    return next((ln for ln in lines if ln.lstrip().startswith("ROOT ")), None)


def _through(defs: dict, name: str):
    """Follow copies, bitcasts, converts and reshapes back to the instruction that made the value: (op, operands,
    line)."""
    for _ in range(64):
        d = defs.get(name)
        if d is None or d[0] not in _PASS_THROUGH or not d[1]:
            return d
        name = d[1][0]
    return None


def _constant(defs: dict, name: str):
    d = _through(defs, name)
    m = re.search(r"constant\((-?\d+)\)", d[2]) if d is not None and d[0] == "constant" else None
    return int(m.group(1)) if m else None


def _counter(defs: dict, name: str):
    """The tuple index of a loop parameter's element that `name` reads, or None."""
    d = _through(defs, name)
    if d is None or d[0] != "get-tuple-element":
        return None
    src = defs.get(d[1][0]) if d[1] else None
    m = _INDEX.search(d[2])
    return int(m.group(1)) if (m and src is not None and src[0] == "parameter") else None


def _derived_trip(comps: dict, defs, caller: str, line: str):
    """The trip count of one `while` from its text, for compilers that record none (TPU's compiled programs): the
    condition is `counter < N` on one element of the loop's tuple, the body adds a constant step to that element,
    and the loop's operand tuple starts it at a constant. Any other shape gives None (the loop stays unknown).
    `defs(name)`: `_defs` of computation `name`, each parsed once however many loops read it; `caller`: the
    computation holding the `while`."""
    m = _WHILE_PARTS.search(line)
    if m is None or m.group(2) not in comps or m.group(3) not in comps:
        return None
    operand, cond, body = m.groups()
    cdefs = defs(cond)
    root = _root(comps[cond])
    r = INSTR.match(root) if root else None
    if r is None or r.group(3) != "compare" or "direction=LT" not in root:
        return None
    ops = _operands(r.group(4))
    if len(ops) != 2:
        return None
    k, limit = _counter(cdefs, ops[0]), _constant(cdefs, ops[1])
    if k is None or limit is None:
        return None
    bdefs = defs(body)
    broot = _root(comps[body])
    b = INSTR.match(broot) if broot else None
    if b is None or b.group(3) != "tuple":
        return None
    outs = _operands(b.group(4))
    add = _through(bdefs, outs[k]) if k < len(outs) else None
    if add is None or add[0] != "add" or len(add[1]) != 2:
        return None
    a0, a1 = add[1]
    step = (
        _constant(bdefs, a1) if _counter(bdefs, a0) == k else _constant(bdefs, a0) if _counter(bdefs, a1) == k else None
    )
    if caller not in comps:
        return None
    tup = _through(defs(caller), operand)
    if not step or step <= 0 or tup is None or tup[0] != "tuple" or k >= len(tup[1]):
        return None
    start = _constant(defs(caller), tup[1][k])
    if start is None:
        return None
    return max(0, -(-(limit - start) // step))


def with_derived_trips(hlo_text: str) -> tuple:
    """(the text with `known_trip_count` written on every `while` whose count the text lacks but its shape gives
    (`_derived_trip`), how many loops still have none)."""
    comps, _ = computations(hlo_text)
    owner = {}
    for name, lines in comps.items():
        for ln in lines:
            owner[ln] = name
    parsed = {}

    def defs(name):
        if name not in parsed:
            parsed[name] = _defs(comps[name])
        return parsed[name]

    out, unknown = [], 0
    for line in hlo_text.splitlines():
        if " while(" in line and not _KNOWN_TRIPS.search(line):
            n = _derived_trip(comps, defs, owner.get(line), line)
            if n is None:
                unknown += 1
            else:
                line += f' backend_config={{"known_trip_count":{{"n":"{n}"}}}}'
        out.append(line)
    return "\n".join(out), unknown


def _multiplicity(comps: dict, entry: str) -> dict:
    """How many times each computation runs per call of the entry (while bodies times their trip count)."""
    edges = {c: [] for c in comps}
    for name, lines in comps.items():
        for line in lines:
            trip = 1
            if " while(" in line:
                m = _KNOWN_TRIPS.search(line)
                if m is None:
                    raise ValueError(f"while loop without known_trip_count in {name}: cannot count its collectives")
                trip = int(m.group(1))
            for callee in _CALLEES.findall(line):
                is_body = f"body={callee}" in line.replace("%", "")
                edges[name].append((callee, trip if is_body else 1))
            for group in _BRANCHES.findall(line):
                edges[name].extend((c.strip().lstrip("%"), 1) for c in group.split(","))
    mult = {entry: 1}
    order, seen = [], set()

    def visit(c):  # post-order DFS: callees after callers in the reversed list
        if c in seen or c not in edges:
            return
        seen.add(c)
        for callee, _ in edges[c]:
            visit(callee)
        order.append(c)

    visit(entry)
    for c in reversed(order):
        for callee, n in edges[c]:
            mult[callee] = mult.get(callee, 0) + mult.get(c, 0) * n
    return mult


def run_bytes(hlo_text: str) -> dict:
    """`collective_bytes_from_hlo` counted as the program runs: each collective's operand bytes times how often its
    computation runs per call (a `while` body: its trip count; nested loops multiply), by kind, with "total" and
    "counts" (instructions in the text, as there). The plain text count reads a loop body once: a program whose
    layer stack is one scan and one whose stack is cut into several scans (the activation codec's hooked layers,
    model/qwen2.py run_layers) hold the same traffic but different numbers of loop bodies."""
    from twocircuit_jax.fast.bytes import collective_bytes_from_hlo

    comps, entry = computations(hlo_text)
    mult = _multiplicity(comps, entry)
    out = {k: 0.0 for k in COLLECTIVE_KINDS}
    counts = {k: 0 for k in COLLECTIVE_KINDS}
    for name, lines in comps.items():
        part = collective_bytes_from_hlo("\n".join(lines))
        for k in COLLECTIVE_KINDS:
            out[k] += part[k] * mult.get(name, 0)
            counts[k] += part["counts"][k]
    out["total"] = sum(out[k] for k in COLLECTIVE_KINDS)
    out["counts"] = counts
    return out


_MEGASCALE = '_xla_host_transfer_handler_name="xla_megascale_runtime"'
_ARRAY = re.compile(r"\b[a-z]+[0-9]*(?:e[0-9]m[0-9][a-z]*)?\[[0-9,]*\]")


def _first_array_bytes(shape: str) -> float:
    """Bytes of the first array of a result shape (a send's payload, before its context and token)."""
    m = _ARRAY.search(shape)
    return shape_bytes(m.group(0)) if m else 0.0


def replica_groups(line: str, n_devices: int) -> list:
    """The device groups of one collective instruction: explicit (`{{0,1},{2,3}}`), iota (`[2,4]<=[4,2]T(1,0)`:
    iota over the second dims, transposed, reshaped to the first) or absent/empty (one group of all devices)."""
    import numpy as np

    m = _IOTA.search(line)
    if m:
        shape = [int(x) for x in m.group(1).split(",")]
        ids = np.arange(int(np.prod([int(x) for x in m.group(2).split(",")]))).reshape(
            [int(x) for x in m.group(2).split(",")]
        )
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return [list(map(int, g)) for g in ids.reshape(shape)]
    m = _GROUPS.search(line)
    groups = [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))] if m else []
    groups = [g for g in groups if g]
    return groups or [list(range(n_devices))]


def slow_share(line: str, base: str, islands) -> float:
    """The share of one collective's bytes that crosses the slow link: 1 or 0 for a grouped collective (does a
    group span islands), the crossing pairs' share for a collective-permute."""
    if islands is None or len(set(islands)) < 2:
        return 0.0
    if base == "collective-permute":
        m = _PAIRS.search(line)
        pairs = re.findall(r"\{(\d+),(\d+)\}", m.group(1)) if m else []
        if not pairs:
            return 0.0
        return sum(islands[int(a)] != islands[int(b)] for a, b in pairs) / len(pairs)
    groups = replica_groups(line, len(islands))
    return float(any(len({islands[i] for i in g}) > 1 for g in groups))


def staged_bytes(hlo_text: str, replicas: int, islands=None) -> dict:
    """{part: bytes per data replica per call} for PARTS, plus "counts" (instructions per part) and "slow" ({part:
    the bytes of those that cross the slow link}, all zero without `islands`)."""
    comps, entry = computations(hlo_text)
    mult = _multiplicity(comps, entry)
    out = {p: 0.0 for p in PARTS}
    slow = {p: 0.0 for p in PARTS}
    counts = {p: 0 for p in PARTS}
    for name, lines in comps.items():
        for line in lines:
            m = INSTR.match(line)
            if not m:
                continue
            shape, op = m.group(2), m.group(3)
            base = op[: -len("-start")] if op.endswith("-start") else op
            dcn_send = base == "send" and _MEGASCALE in line
            if base not in COLLECTIVE_KINDS and not dcn_send:
                continue
            op_name = (OP_NAME.search(line) or [None, ""])[1]
            b = (_first_array_bytes(shape) if dcn_send else shape_bytes(shape)) * mult.get(name, 0)
            if base == "collective-permute":
                pairs = _PAIRS.search(line)
                n_pairs = pairs.group(1).count("{") if pairs else replicas
                b *= n_pairs / replicas
            if "stage_boundary" in op_name:  # a transposed send, or a format's own backward send
                back = "transpose(" in op_name or "stage_boundary_back" in op_name
                part = "boundary_bwd" if back else "boundary_fwd"
            elif "stage_exit" in op_name:
                part = "stage_exit"
            else:
                part = "grad_reduce"
            out[part] += b
            slow[part] += b if dcn_send else b * slow_share(line, base, islands)
            counts[part] += 1
    out["counts"] = counts
    out["slow"] = slow
    return out


def step_comm(jitted, args, replicas: int, ticks: int) -> dict:
    """{"comm/hlo/<part>": bytes per data replica per GRPO step} of a staged train step, read from its compiled
    program: `jitted` is compiled ahead of its first call (the call then reuses that executable: no second compile),
    and every part is counted as `staged_bytes` does, times the step's `ticks` (mini-batches x epochs)."""
    parts = staged_bytes(jitted.lower(*args).compile().as_text(), replicas)
    return {f"comm/hlo/{p}": parts[p] * ticks for p in PARTS}


def memory_bytes(compiled) -> dict:
    """Per-device bytes of a compiled program (XLA's memory analysis): arguments, outputs, temporaries."""
    m = compiled.memory_analysis()
    if m is None:
        raise ValueError("this backend reports no memory analysis for compiled programs")
    return {
        "argument": float(m.argument_size_in_bytes),
        "output": float(m.output_size_in_bytes),
        "temp": float(m.temp_size_in_bytes),
        "alias": float(getattr(m, "alias_size_in_bytes", 0)),
    }


def describe(parts: dict) -> str:
    return json.dumps({k: round(v) for k, v in parts.items() if k in PARTS})
