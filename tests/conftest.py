"""Test setup: 8 fake CPU devices, float32 matmuls, tiny HF checkpoints built locally."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
from tests.tools_util import TEST_XLA_FLAGS, shared_run  # noqa: E402 (numpy only: before jax starts)

# Eight fake CPU devices for the meshes, and fast compiles (`TEST_XLA_FLAGS`).
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8 {TEST_XLA_FLAGS}"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from tests.hf_utils import CONFIGS, make_hf_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """name -> directory of a tiny random HF Qwen3 checkpoint (see `CONFIGS`)."""
    root = tmp_path_factory.mktemp("hf")
    return {name: make_hf_checkpoint(root / name, **kw) for name, kw in CONFIGS.items()}


@pytest.fixture(params=sorted(CONFIGS))
def checkpoint(request, checkpoints):
    """Each tiny checkpoint in turn: (name, directory)."""
    return request.param, checkpoints[request.param]


@pytest.fixture(scope="session")
def trained_tiny(tmp_path_factory, worker_id):
    """The `tiny` preset trained by `tools/train.py` (shortened run), once per session
    (`shared_run`)."""
    from tests.tools_util import load_tool, tool_args

    train = load_tool("train")
    return shared_run(tmp_path_factory, worker_id, "trained-tiny", lambda out: train.main(
        tool_args(train, output_dir=str(out), steps=40, progress=False, overwrite=True)))


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_functions_after_each_module():
    """Each xdist worker runs ~170 tests; without this, every jitted function it
    compiled stays cached until the end, and a worker grows by several GB."""
    yield
    jax.clear_caches()


@pytest.fixture
def eqx_log():
    """The messages the package logger emits during the test (its own handler: the
    tools' `enable_console_logging` stops propagation to the root logger)."""
    import logging

    records: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("eqx_tx")
    handler, level = _Collect(logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(level)
