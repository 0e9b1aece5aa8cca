"""`tools/train.py`, except that process 1 dies after writing its checkpoint shards of
step 4, before the commit: a crash mid-save, for `test_multihost`.

The crash comes through `eqx_tx.train.checkpoint._after_shards_written`, the save path's
test-only hook, replaced here; the library itself never reads a fault setting.
"""

import os
import runpy
import sys

import eqx_tx.train.checkpoint

TRAIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "train.py")


def _die_at_step_4(step: int) -> None:
    import jax

    if jax.process_index() == 1 and step == 4:
        os._exit(17)


eqx_tx.train.checkpoint._after_shards_written = _die_at_step_4
sys.argv = [TRAIN, *sys.argv[1:]]
runpy.run_path(TRAIN, run_name="__main__")
