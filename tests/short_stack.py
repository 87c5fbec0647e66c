"""The narrow run (tiny_run.narrow_run_config) at 2 layers for the tests whose property holds at any depth: the
layers unroll (model.scan_layers off), so each one adds its share to every compile, and a 4-layer stack doubled the
compile time of tests that split rows (micro-batch accumulation) or compare a step with its reference step."""

from tiny_run import narrow_run_config


def narrow2_run_config(kl_coef: float = 0.0, **fast):
    """narrow_run_config's run with num_layers 2 and pp_size 2: one codec boundary, after layer 0."""
    return narrow_run_config(kl_coef, num_layers=2, **{"pp_size": 2, **fast})
