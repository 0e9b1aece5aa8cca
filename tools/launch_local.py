"""Start N local processes of a multi-host run (e.g. to try it on one machine).

Each process gets `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES` and
`JAX_PROCESS_ID` (which `eqx_tx.core.distributed.initialize` reads) and its own fake CPU
devices; output lines are prefixed with the process id. If one process fails, the
others are stopped.

    python tools/launch_local.py --num-processes 2 --devices-per-process 4 -- tools/train.py --tp 2
"""

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading

import tyro


@dataclasses.dataclass
class Args:
    num_processes: int = 2
    """Processes to start on this machine (each gets its share of the devices)."""
    devices_per_process: int = 4
    """Fake CPU devices per process (XLA_FLAGS); ignored with --no-cpu."""
    cpu: bool = True
    """Run on CPU devices (JAX_PLATFORMS=cpu) with gloo collectives."""
    port: int = 0
    """Coordinator port on localhost (0: a free one)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(stream, prefix: str, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(prefix + line)
        out.flush()


def launch(args: Args, command: list[str]) -> int:
    if not command:
        raise ValueError("no command: pass the script and its arguments after --")
    port = args.port or _free_port()
    procs, threads = [], []
    for i in range(args.num_processes):
        env = dict(os.environ, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(args.num_processes),
                   JAX_PROCESS_ID=str(i), PYTHONUNBUFFERED="1")
        if args.cpu:
            env["JAX_PLATFORMS"] = "cpu"
            env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices_per_process}"
        p = subprocess.Popen([sys.executable, *command], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
        procs.append(p)
        t = threading.Thread(target=_pump, args=(p.stdout, f"[{i}] ", sys.stdout), daemon=True)
        t.start()
        threads.append(t)
    code = 0
    remaining = list(procs)
    while remaining:
        for p in list(remaining):
            try:
                rc = p.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                continue
            remaining.remove(p)
            if rc != 0 and code == 0:
                code = rc
                for other in remaining:  # one failed: the run cannot continue
                    other.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(timeout=5)
    return code


if __name__ == "__main__":
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    parsed = tyro.cli(Args, args=argv[:split])
    sys.exit(launch(parsed, argv[split + 1 :]))
