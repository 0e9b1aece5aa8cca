"""Multi-host runs on JAX's own multi-controller runtime (`jax.distributed`).

One process per host, one global mesh: every process runs the same program; the
mesh (`eqx_tx.make_mesh`) spans all processes' devices, with consecutive devices
(one host's) in the `tp` axis. Batches are assembled from each process's share of
the rows (`global_batch`), and results read back with `to_host`.
"""

import dataclasses
import os
import socket
import time

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from .log import logger
from .sharding import logical_to_spec


@dataclasses.dataclass
class DistributedArgs:
    """How to join a multi-process run (all optional: a single process by default).

    Unset fields are read from `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES` and
    `JAX_PROCESS_ID`, or detected by JAX on a cluster it knows (e.g. Slurm).
    """

    coordinator_address: str | None = None
    """host:port of process 0's coordinator service."""
    num_processes: int | None = None
    """How many processes the run has (one per host, or per local launch)."""
    process_id: int | None = None
    """This process's rank, 0 .. num_processes - 1 (0 runs the coordinator)."""
    initialization_timeout: int = 120
    """Seconds to wait for the coordinator before giving up."""
    heartbeat_timeout: int = 100
    """Seconds without a heartbeat before a peer counts as dead."""


def _cluster_detected() -> bool:
    return any(int(os.environ.get(var, "1")) > 1 for var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"))


def initialize(args: DistributedArgs | None = None) -> bool:
    """Call `jax.distributed.initialize` if this is a multi-process run; call it before
    anything touches a device. **Returns** whether it did.

    CPU collectives use gloo, so the same code runs on a CPU cluster (or several local
    processes, see `tools/launch_local.py`).
    """
    args = args or DistributedArgs()
    address = args.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    num = args.num_processes if args.num_processes is not None else _env_int("JAX_NUM_PROCESSES")
    pid = args.process_id if args.process_id is not None else _env_int("JAX_PROCESS_ID")
    if address is None and num is None and pid is None and not _cluster_detected():
        return False
    if num == 1:
        return False
    if address is not None and pid not in (None, 0):
        _wait_for_coordinator(address, args.initialization_timeout, pid)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator_address=address,
            num_processes=num,
            process_id=pid,
            initialization_timeout=args.initialization_timeout,
            heartbeat_timeout_seconds=args.heartbeat_timeout,
        )
    except Exception as e:  # noqa: BLE001 - JAX raises several types here
        raise RuntimeError(
            f"process {pid} could not join the run at coordinator {address} "
            f"(within {args.initialization_timeout} s): {e}"
        ) from None
    logger.info(f"process {jax.process_index()} of {jax.process_count()}: "
                f"{jax.local_device_count()} local devices, {jax.device_count()} in all")
    return True


def _wait_for_coordinator(address: str, timeout: float, pid) -> None:
    """Fail with a message naming `address` if nothing listens there within `timeout`
    (JAX itself would abort the process without saying which address it tried)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=min(2.0, timeout)):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"process {pid} could not join the run at coordinator {address} (within {timeout} s): "
                    f"nothing accepts connections there ({e.strerror or e})"
                ) from None
            time.sleep(0.25)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return None if value in (None, "") else int(value)


def is_main_process() -> bool:
    return jax.process_index() == 0


def batch_sharding(mesh, batch_size: int) -> NamedSharding:
    """How a `[batch, ...]` array is laid out: the `batch` rule (over `dp` and `ep`)."""
    return NamedSharding(mesh, logical_to_spec(("batch",), (batch_size,), mesh))


def local_rows(mesh, batch_size: int) -> slice:
    """The rows of a `[batch, ...]` array that this process's devices hold."""
    indices = batch_sharding(mesh, batch_size).addressable_devices_indices_map((batch_size,))
    rows = [idx[0].indices(batch_size)[:2] for idx in indices.values() if idx is not None]
    start, stop = min(r[0] for r in rows), max(r[1] for r in rows)
    return slice(start, stop)


def global_batch(tree, mesh, batch_size: int):
    """Assemble `[batch, ...]` arrays sharded by the `batch` rule from this process's
    rows (`tree` holds only the rows `local_rows(mesh, batch_size)`)."""
    sharding = batch_sharding(mesh, batch_size)
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x), (batch_size, *x.shape[1:])), tree
    )


def to_host(x) -> np.ndarray:
    """The whole value of `x` on this host (gathered from all processes if needed).
    Every process must call it, in the same order."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    if x.sharding.is_fully_replicated:
        return np.asarray(x.addressable_shards[0].data)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def host_device():
    """This process's CPU device, so tensors read from disk stay in host memory."""
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return None
