"""Trip counts of loops in TPU-compiled programs, which record none (fast/hlo_bytes.py `with_derived_trips`): a
loop of the usual shape (`i < N`, `i += step`, `i` from a constant) has its count read from its text, so the
plan counts each collective in a scan body as often as it runs; a loop of any other shape stays unknown, and the
plan says its count is a lower bound (plan/measure.py `collectives`)."""

import os
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from twocircuit_jax.fast.hlo_bytes import with_derived_trips
from twocircuit_jax.plan import measure, targets

# A loop as TPU's compiler writes it (copies and a sunk constant included): the counter is element 0, it starts at
# START (through a copy), steps by STEP and stops at LIMIT.
TEXT = """HloModule m

%cond (p: (s32[], f32[4])) -> pred[] {
  %p = (s32[], f32[4]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(LIMIT)
  ROOT %lt = pred[] compare(%i, %n), direction=DIR
}

%body (q: (s32[], f32[4])) -> (s32[], f32[4]) {
  %q = (s32[], f32[4]) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %c = s32[] copy(%j)
  %one = s32[] constant(STEP)
  %next = s32[] add(%c, %one)
  %x = f32[4] get-tuple-element(%q), index=1
  %y = f32[4] all-reduce(%x), replica_groups={}, to_apply=%sum
  ROOT %t = (s32[], f32[4]) tuple(%next, %y)
}

ENTRY %main (a: f32[4]) -> (s32[], f32[4]) {
  %a = f32[4] parameter(0)
  %z = s32[] constant(START)
  %zc = s32[] copy(%z)
  %init = (s32[], f32[4]) tuple(%zc, %a)
  ROOT %w = (s32[], f32[4]) while(%init), condition=%cond, body=%body
}
"""


def _loop(limit, start=0, step=1, direction="LT"):
    t = TEXT.replace("LIMIT", str(limit)).replace("START", str(start)).replace("STEP", str(step))
    return t.replace("DIR", direction)


def _trips(text):
    out, unknown = with_derived_trips(text)
    return [int(n) for n in re.findall(r'"known_trip_count":\{"n":"(\d+)"\}', out)], unknown


@pytest.mark.parametrize(
    "limit,start,step,want",
    [(12, 0, 1, 12), (10, 2, 1, 8), (10, 0, 3, 4), (3, 5, 1, 0)],
)
def test_the_count_of_a_counted_loop_is_read_from_its_text(limit, start, step, want):
    assert _trips(_loop(limit, start, step)) == ([want], 0)


@pytest.mark.parametrize("direction", ["GT", "NE"])
def test_a_loop_of_another_shape_stays_unknown(direction):
    assert _trips(_loop(12, direction=direction)) == ([], 1)


def test_a_recorded_count_is_kept():
    text = _loop(12).replace("body=%body", 'body=%body, backend_config={"known_trip_count":{"n":"7"}}')
    assert _trips(text) == ([7], 0)


def test_an_unknown_loop_with_a_collective_is_a_lower_bound():
    parts, note, _ = measure.collectives(_loop(12, direction="NE"), replicas=1)
    assert parts["grad_reduce"] == 16.0 and "lower bound" in note  # f32[4] once
    parts, note, _ = measure.collectives(_loop(12), replicas=1)
    assert parts["grad_reduce"] == 16.0 * 12 and note == ""


@pytest.mark.tpu_compile
@pytest.mark.parametrize("layers", [6, 12])
def test_a_tpu_scan_counts_its_collective_once_per_layer(layers):
    """A scan over layers with a sum over the data axis in its body, compiled for a v5e-8: the plan's bytes are the
    body's all-reduce (one device's f32[8,256] rows, 8 KiB) times the layers, plus the loss's scalar sums outside
    the loop; counted once it would be 8 KiB and a note."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    mesh = Mesh(targets.devices(targets.parse("tpu:v5e-8")), ("data",))

    def f(w, x):
        def body(c, wi):
            c = jnp.tanh(c @ wi)
            return jax.lax.with_sharding_constraint(c, NamedSharding(mesh, P())) * 1.0, None

        y, _ = jax.lax.scan(body, x, w)
        return jnp.sum(y)

    w = jax.ShapeDtypeStruct((layers, 256, 256), jnp.float32, sharding=NamedSharding(mesh, P(None, "data")))
    x = jax.ShapeDtypeStruct((8, 256), jnp.float32, sharding=NamedSharding(mesh, P()))
    text = jax.jit(f).lower(w, x).compile().as_text()
    assert " while(" in text and "known_trip_count" not in text  # TPU records none: the case this reads
    assert _trips(text) == ([layers], 0)
    parts, note, _ = measure.collectives(text, replicas=8)
    assert note == ""
    assert layers * 8 * 256 * 4 <= parts["grad_reduce"] <= layers * 8 * 256 * 4 + 64
