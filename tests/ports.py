"""Loopback ports for the tests' servers (the GCS emulator, a simulated slice's coordinator).

A port found free by binding port 0 and closing it comes from the kernel's ephemeral range, where
the other pytest-xdist worker picks its own at the same moment (and where every outgoing
connection takes one): two tests can be handed the same port. Here each worker draws from a block
of its own below the ephemeral range (Linux's default is 32768-60999), walking it from a random
start, and skips a port something else already holds, so two workers of one run never share one.
"""
import os
import random
import socket

FIRST_PORT, BLOCK = 20000, 1500  # worker gwN's ports: FIRST_PORT + N*BLOCK ... + BLOCK - 1 (8 workers below 32000)

_next: list[int] = []


def _worker_index() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    digits = worker[2:] if worker.startswith("gw") else ""
    return int(digits) % 8 if digits.isdigit() else 0


def free_port() -> int:
    """A loopback port that no other worker of this test run is handed, and that nothing held when asked."""
    base = FIRST_PORT + _worker_index() * BLOCK
    if not _next:
        _next.append(random.randrange(BLOCK))
    for _ in range(BLOCK):
        port = base + _next[0] % BLOCK
        _next[0] += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # held by something else (or closing): the next one
        return port
    raise RuntimeError(f"no free loopback port in {base}-{base + BLOCK - 1}")
