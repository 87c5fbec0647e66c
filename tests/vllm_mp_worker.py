"""One trainer process of tests/test_vllm_multiprocess.py: jax.distributed on the loopback interface, a GRPOTrainer
with the run's config, `--steps` steps (or to the end) and one held-out evaluation, then every step's metrics and the
evaluation's as this process computed them into `--rows` (only process 0 writes metrics.jsonl; the others' metrics exist only here).

`--broadcast-check`: before the run, the ragged-Rollout broadcast of sampler/process_zero.py on its own, with real
collectives: the results go into `--rows` beside the metrics.
"""

import argparse
import json
import math
import sys


def broadcast_checks() -> dict:
    import jax

    from twocircuit_jax.sampler.base import Rollout
    from twocircuit_jax.sampler.process_zero import (
        ProcessZeroError,
        broadcast_bytes,
        dumps,
        loads,
        pack_rollout,
        unpack_rollout,
    )

    # ragged rows (1, 3 and 0 tokens), log-probs whose float64 bits a float32 trip would change, one truncated row
    want = Rollout(
        [[5], [7, 8, 9], []], [[-0.1], [-1e-300, -2.0 / 3.0, -1234.5678901234567], []], [False, True, False], 7
    )
    mine = want if jax.process_index() == 0 else Rollout([[1, 2]], [[-9.0, -9.0]], [True], 99)  # others: not sent
    got = unpack_rollout(loads(broadcast_bytes(lambda: dumps(pack_rollout(mine), {})))[0])
    big = broadcast_bytes(lambda: bytes(range(256)) * 20)  # past the first 1 KiB bucket

    def gone():
        raise ValueError("engine gone")

    try:  # a failure on process 0 is every process's failure, at the same collective
        broadcast_bytes(gone)
        failed = "no error"
    except ProcessZeroError as e:
        failed = f"ProcessZeroError: {e}"
    except ValueError as e:
        failed = f"ValueError: {e}"
    return {
        "rollout_equal": got == want
        and all(
            [math.copysign(1, x) for x in a] == [math.copysign(1, x) for x in b]
            for a, b in zip(got.logprobs, want.logprobs)
        ),
        "big_equal": big == bytes(range(256)) * 20,
        "failed": failed,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--rows", required=True)
    p.add_argument("--coordinator", required=True)
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--num-processes", type=int, default=2)
    p.add_argument("--steps", type=int, default=0, help="steps to run in this launch (0: to the end)")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--broadcast-check", action="store_true")
    a = p.parse_args(argv)

    from twocircuit_jax.parallel import distributed

    distributed.initialize(distributed.Launch("flags", a.coordinator, a.num_processes, a.process_id))
    from twocircuit_jax.config import load_config
    from twocircuit_jax.train.loop import GRPOTrainer

    out = {"broadcast": broadcast_checks() if a.broadcast_check else None, "rows": []}
    tr = GRPOTrainer(load_config(a.config), a.out, resume=a.resume, show_progress=False)
    with tr:
        last = tr.built.cfg.train.steps if not a.steps else min(tr.built.cfg.train.steps, tr.gs + a.steps)
        while tr.gs < last:
            out["rows"].append(tr.step())
        # a held-out evaluation: the sampler's plain generate (no step-ahead thread), broadcast from process 0
        out["eval"] = tr.evaluate(tr.gs)
    with open(a.rows, "w") as fh:
        json.dump(out, fh, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
