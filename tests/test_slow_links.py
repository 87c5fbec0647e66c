"""Slow and fast links on 8 fake CPU devices: the dcn_* config keys and their refusal, the islands' device order
(contiguous groups where devices report no slices), a train step on a dcn_data=2 mesh equal to the plain mesh's,
and the HLO classification of collectives by link on a hand-written program."""

import os

import jax
import numpy as np
import pytest

from twocircuit_jax.config import MeshConfig, load_config
from twocircuit_jax.config.base import ConfigError
from twocircuit_jax.fast.hlo_bytes import replica_groups, staged_bytes
from twocircuit_jax.parallel import mesh as pmesh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")


@pytest.mark.parametrize("key", ["dcn_fsdp", "dcn_tensor"])
def test_fsdp_or_tensor_over_the_slow_link_is_refused(key):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, [f"mesh.{key}=2"])
    assert e.value.path == f"mesh.{key}" and "allow_slow_sharding" in e.value.message
    cfg = load_config(TINY, [f"mesh.{key}=2", "mesh.allow_slow_sharding=true"])
    assert getattr(cfg.mesh, key) == 2
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["mesh.dcn_data=0"])
    assert e.value.path == "mesh.dcn_data"


def test_axis_size_is_island_times_dcn():
    assert pmesh.mesh_shape(MeshConfig(data=2, fsdp=2, dcn_data=2), 8) == {
        "data": 4,
        "stage": 1,
        "fsdp": 2,
        "tensor": 1,
    }
    assert pmesh.mesh_shape(MeshConfig(data=-1, dcn_data=2), 8)["data"] == 8  # -1 fills the island (4 devices)
    assert pmesh.island_shape(MeshConfig(data=-1, dcn_data=2), 8)["data"] == 4
    with pytest.raises(ConfigError) as e:
        pmesh.mesh_shape(MeshConfig(data=-1, dcn_data=3), 8)
    assert e.value.path == "mesh.dcn_data"
    with pytest.raises(ConfigError, match="in each of 2 islands"):
        pmesh.mesh_shape(MeshConfig(data=2, fsdp=1, dcn_data=2), 8)


def test_islands_are_contiguous_device_groups():
    devs = jax.devices()
    cfg = MeshConfig(data=2, fsdp=2, dcn_data=2)
    m = pmesh.make_mesh(cfg, devs)
    assert dict(m.shape) == {"data": 4, "stage": 1, "fsdp": 2, "tensor": 1}
    # data positions 0, 1 are island 0 (devices 0-3), positions 2, 3 island 1 (devices 4-7)
    assert [d.id for d in m.devices.flat] == list(range(8))
    assert pmesh.islands(cfg, m) == [0, 0, 0, 0, 1, 1, 1, 1]
    cfg = MeshConfig(data=2, stage=2, dcn_stage=2)
    m = pmesh.make_mesh(cfg, devs)
    ids = np.vectorize(lambda d: d.id)(m.devices)[:, :, 0, 0]
    assert ids.tolist() == [[0, 1, 4, 5], [2, 3, 6, 7]]  # stages 0-1 on island 0, 2-3 on island 1
    assert pmesh.islands(cfg, m) == [0, 0, 1, 1, 0, 0, 1, 1]
    for isl in (0, 1):  # each island is a contiguous block of the device list
        assert sorted(d.id for d, i in zip(m.devices.flat, pmesh.islands(cfg, m)) if i == isl) == list(
            range(4 * isl, 4 * isl + 4)
        )


def test_train_step_on_dcn_mesh_equals_plain_mesh():
    from test_train_step import _batch, _build

    out = {}
    for name, mcfg in [("plain", MeshConfig(data=4, fsdp=2)), ("dcn", MeshConfig(data=2, fsdp=2, dcn_data=2))]:
        mesh, jitted, state, _, bsh = _build(mcfg, jax.devices())
        assert dict(mesh.shape)["data"] == 4
        for s in range(2):
            state, _, m = jitted(state, None, jax.device_put(_batch(s), bsh))
        out[name] = (jax.device_get(state.params), jax.device_get(m))
    for a, b in zip(jax.tree.leaves(out["plain"]), jax.tree.leaves(out["dcn"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


HLO = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (p: f32[256]) -> f32[256] {
  %p = f32[256]{0} parameter(0)
  %ar.fast = f32[256]{0} all-reduce(%p), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  %ar.slow = f32[256]{0} all-reduce(%ar.fast), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add
  %ag = f32[512]{0} all-gather(%ar.slow), channel_id=3, replica_groups=[2,4]<=[8], dimensions={0}
  %cp = f32[256]{0} collective-permute(%ar.slow), channel_id=4, source_target_pairs={{0,1},{1,2},{3,4},{4,5}}
  %tok = token[] after-all()
  %send = (f32[64]{0}, u32[], token[]) send(%p, %tok), channel_id=5, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime"}
  %sd = token[] send-done(%send), channel_id=5, is_host_transfer=true
  ROOT %r = f32[256]{0} add(%cp, %ar.slow)
}
"""


def test_hlo_collectives_by_link():
    line = [x for x in HLO.splitlines() if "%ar.slow =" in x][0]
    assert replica_groups(line, 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    got = staged_bytes(HLO, replicas=8, islands=[0, 0, 0, 0, 1, 1, 1, 1])
    # all-reduces 1024 + 1024, all-gather 2048, the permute's 4 pairs over 8 replicas 512, the DCN send's payload 256
    assert got["grad_reduce"] == 1024 + 1024 + 2048 + 512 + 256
    # across islands: the strided all-reduce, one pair of four of the permute, the send; the all-gather's groups
    # [0-3] and [4-7] stay inside
    assert got["slow"]["grad_reduce"] == 1024 + 512 / 4 + 256
    assert staged_bytes(HLO, replicas=8)["slow"]["grad_reduce"] == 256  # one island: only the DCN runtime's send
