"""The plan as text: one row per program, then the resident state, the peak against the chip, host memory and the
roofline bounds; when it does not fit, the largest buffers of the program that peaks."""

from __future__ import annotations


def size(b) -> str:
    if b is None:
        return "-"
    for unit, k in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= k:
            return f"{b / k:.2f} {unit}"
    return f"{b:.0f} B"


def seconds(s) -> str:
    """A duration for the plan's reports: µs below a millisecond, ms below a second, else seconds."""
    if s < 1e-3:
        return f"{s * 1e6:.2f} µs"
    return f"{s * 1e3:.3f} ms" if s < 1 else f"{s:,.2f} s"


def _flop(f) -> str:
    return f"{f / 1e12:.3f} TFLOP" if f >= 1e12 else f"{f / 1e9:.3f} GFLOP"


def render(plan: dict, k: int = 5) -> str:
    chip, out = plan["chip"], []
    mesh = " ".join(f"{a}={v}" for a, v in plan["mesh"].items())
    isl = plan.get("islands", 1)
    where = f", {isl} islands over the slow link" if isl > 1 else ""
    out.append(f"plan for {plan['target']}: {plan['devices']} devices ({mesh}{where}); per device, per call")
    head = ["program", "calls/step", "args", "temp", "out", "alias", "peak", "GFLOP", "HBM bytes", "coll bytes"]
    if isl > 1:
        head.append("slow bytes")
    if chip:
        head.append("bound (limit)")
    table = [head]
    for name, r in plan["programs"].items():
        m = r["memory"]
        row = [name, f"{r['runs_per_step']:g}", size(m["argument"]), size(m["temp"]), size(m["output"])]
        c = r["cost"] or {}
        row += [size(m["alias"]), size(r["peak"]), f"{c['flops'] / 1e9:.3f}" if c else "-"]
        row += [size(c.get("bytes_accessed")), size(r["collective_bytes"])]
        if isl > 1:
            row.append(size(r.get("slow_bytes")))
        if chip:
            rl = r.get("roofline")
            row.append(f"{seconds(rl['bound_s'])} ({rl['limit']})" if rl else "refused (HBM)")
        table.append(row)
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    out += ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in table]
    res = plan["resident"]
    out.append("resident: " + ", ".join(f"{n} {size(v)}" for n, v in res.items() if n != "total" and v))
    out.append(f"  total {size(res['total'])} (+ the program's own arguments, unaliased outputs and temporaries)")
    p = plan["peak"]
    if chip:
        verdict = "fits" if p["fits"] else "DOES NOT FIT"
        out.append(
            f"peak {size(p['bytes'])} in {p['program']} against {size(p['hbm_bytes'])} HBM ({chip['name']}): {verdict}"
        )
    else:
        out.append(f"peak {size(p['bytes'])} in {p['program']} (fake CPU devices: no chip memory to fit into)")
    h = plan["host"]
    if h["anchor_snapshots"]:
        out.append(
            f"host: anchor {h['anchor_snapshots']} weight snapshots {size(h['anchor_snapshot_bytes'])}, "
            f"{h['anchor_batches']} retained mini-batches (on device, in resident)"
        )
    for name, r in plan["programs"].items():
        g = r.get("generation")
        if g:
            what = "held-out evaluation" if name == "generate_eval" else "rollouts"
            how = "greedy" if g["greedy"] else "sampled"
            cap = g["rows_per_call"]
            cap = "sized from the memory the resident state leaves" if cap == "auto" else f"max_rows_per_call {cap}"
            out.append(
                f"{name}: {what}, {r['runs_per_step']:g} calls/step of {g['prompts']} prompts x {g['n']} = "
                f"{r['rows']} rows ({cap}), {g['prompt_len']} + {g['max_new']} positions, {how}"
            )
    s = plan["step"]
    out.append(
        f"step: {s['ticks']} ticks, {s['params'] / 1e6:.2f} M params, model {_flop(s['model_flops'])} "
        f"(6N/token trained, 2N/token forward-only), collectives {size(s['collective_bytes'])} per replica"
    )
    if "step_bound_s" in s:
        if s.get("dcn_gbps"):
            out.append(f"slow-link bytes at {s['dcn_gbps']:g} Gbit/s per device (--dcn-gbps), fast-link bytes at ICI")
        out.append(
            f"roofline lower bound: tick {seconds(s['tick_bound_s'])}, step {seconds(s['step_bound_s'])} "
            f"(generation {seconds(s['generation_bound_s'])} at the length cap, training {seconds(s['train_bound_s'])}); "
            f"MFU at most {100 * s['mfu_bound']:.1f}%"
        )
    notes = [f"{n}: {r['note']}" for n, r in plan["programs"].items() if r["note"]]
    notes += [f"{n}: the TPU compiler refused it: {r['oom']}" for n, r in plan["programs"].items() if r["oom"]]
    out += [f"note {x}" for x in notes]
    if p["fits"] is False:
        out.append(f"largest buffers of {p['program']} (what to shrink; temp = the compiler's temporaries):")
        for b in plan["programs"][p["program"]]["largest"][:k]:
            out.append(f"  {size(b['bytes']):>12}  {b['op']} {b['shape']} [{b['space']}] {b['source']}")
    return "\n".join(out)
