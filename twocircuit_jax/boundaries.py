"""Logical pipeline boundaries (design §3.1), the one place they are computed: the fast circuit's codec
boundaries (fast.pp_size) and the real stages' ends (mesh.stage) are both `boundary_layers`, and the rule that ties
them (`codec_stage_mismatch`) is coded here once for the config check and the loaded model's check.

L decoder blocks are split into `pp_size` contiguous stages, the first `L mod pp_size` stages one block longer;
a boundary is the last block of every stage except the final one, so there are pp_size - 1 boundaries.
    L=28, pp=8 -> (3, 7, 11, 15, 18, 21, 24);   L=16, pp=8 -> (1, 3, 5, 7, 9, 11, 13);   pp=1 -> ()
"""

from __future__ import annotations


def stage_sizes(num_layers: int, pp_size: int) -> tuple[int, ...]:
    """Blocks per stage: the first L mod pp stages get one extra block."""
    if num_layers < 1:
        raise ValueError(f"model.num_layers: got {num_layers}; must be >= 1")
    if not 1 <= pp_size <= num_layers:
        raise ValueError(f"fast.pp_size: got {pp_size}; allowed 1..model.num_layers={num_layers}")
    base, extra = divmod(num_layers, pp_size)
    return tuple(base + (1 if s < extra else 0) for s in range(pp_size))


def boundary_layers(num_layers: int, pp_size: int) -> tuple[int, ...]:
    """0-based index of the last block of each stage but the final one."""
    out, end = [], -1
    for size in stage_sizes(num_layers, pp_size)[:-1]:
        end += size
        out.append(end)
    return tuple(out)


def codec_stage_mismatch(num_layers: int, pp_size: int, stages: int) -> str | None:
    """None when every codec boundary is a stage boundary (there is nothing to compress where no stage ends), else
    the message for a ConfigError on fast.pp_size."""
    codec_b, stage_b = boundary_layers(num_layers, pp_size), boundary_layers(num_layers, stages)
    if set(codec_b) <= set(stage_b):
        return None
    return (
        f"got {pp_size}: codec boundaries {codec_b} are not all stage boundaries {stage_b} of "
        f"mesh.stage={stages}; use a pp_size that divides mesh.stage"
    )
