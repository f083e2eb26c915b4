"""The only file that speaks torch_xla SPMD: runtime start, the device mesh, sharding
annotations, the small cross-host protocol (barrier, broadcast, config check), and the few
runtime calls the training loop needs (sync, counters, profiles, the accelerator's kind, device
memory); training/capture.py holds the rest.

Data parallel over one global 1-D mesh named "data": batch-shaped tensors (inputs, the ACT
carry) and the puzzle-embedding table are split on their first dimension across every device
of every host; parameters and optimizer state are replicated. Every host runs the same
program; the runtime finds its peers from the TPU VM metadata.

The mesh lists the devices in host order (`DeviceLayout`): host 0's devices as its runtime
lists them, then host 1's, and so on. Device ids are not host-contiguous on every slice (a
v5litepod-16's host 0 owns ids 0, 1, 4, 5), and a host's slice of each batch lands on its own
devices in the order its runtime lists them, wherever they sit in the mesh; in host order, host
p's devices hold the global rows [p·B/P, (p+1)·B/P), so every row-to-host mapping (batches,
carry and puzzle-table checkpoint shares, evaluation outputs) derives from the layout alone.
`check_row_placement` proves it on every slice before the first step.
"""
from __future__ import annotations

import datetime
import functools
import hashlib
import math
import os
import re
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

_spmd_on = False

# A simulated slice, for tests of what crosses hosts: TRM_SIMULATED_SLICE="RANK/COUNT@tcp://HOST:PORT"
# makes this process host RANK of COUNT for everything between hosts (the host group, checkpoint
# files, the SIGTERM agreement, the watchdog) while it runs the whole program on its own CPU mesh
# and reads every row of every batch: all processes hold the same state, as the hosts of a pod do.
SIMULATED_SLICE_ENV = "TRM_SIMULATED_SLICE"
# With a simulated slice, the device ids each simulated host owns, as a real slice's runtime lists
# them: TRM_SIMULATED_DEVICES="0,1,4,5|2,3,6,7" (host 0 | host 1 | ...); default: contiguous blocks.
# The upload of a host's rows then lands where the runtime would put them (`_place_like_the_runtime`).
SIMULATED_DEVICES_ENV = "TRM_SIMULATED_DEVICES"


def _simulated_slice() -> tuple[int, int, str] | None:
    value = os.environ.get(SIMULATED_SLICE_ENV)
    if not value:
        return None
    try:
        ranks, address = value.split("@", 1)
        rank, count = (int(x) for x in ranks.split("/"))
    except ValueError:
        raise ValueError(f"{SIMULATED_SLICE_ENV}={value!r}: expected RANK/COUNT@tcp://HOST:PORT") from None
    return rank, count, address


class NoTPUError(RuntimeError):
    pass


# The CPU mesh's thread pool. XLA's PJRT CPU client (the one torch_xla 2.9 creates) runs every
# device's share of a program as one task on one pool of max(PJRT_NPROC or the core count,
# devices) threads, one program with collectives at a time, and each all-reduce waits until
# every device's task arrives (10 s, then it aborts the process: rendezvous.cc "Termination
# timeout"). The same pool runs the dispatch of the next program, one task per device, and that
# task blocks while its device already has 32 programs in flight (the client's
# max_inflight_computations_per_device, which torch_xla does not set). A host that runs 32
# programs ahead of the devices (an evaluation at K=16 trajectories on 2 cores does: its steps
# read no device value) so filled the pool of 8 with 7 devices' tasks of the running program
# waiting in its all-reduce and 1 blocked dispatch task: the 8th device's task never started.
# torch_xla dispatches one program at a time, so at most `devices` dispatch tasks block; twice
# the device count leaves the running program a thread for every device. The client's intra-op
# pool takes the same size (its cost on the demo: docs/measurements.md), and its reductions split
# otherwise (the last bits move).
CPU_POOL_ENV = "PJRT_NPROC"


def size_cpu_client_pool(devices: int) -> int:
    """Give the PJRT CPU client (before it starts) a pool of at least 2 x `devices` threads
    (PJRT_NPROC; a larger value already set there or in NPROC, which it reads next, is kept);
    return the size."""
    given = os.environ.get(CPU_POOL_ENV) or os.environ.get("NPROC") or ""
    threads = max(2 * devices, int(given) if given.isdigit() else 0)
    os.environ[CPU_POOL_ENV] = str(threads)
    return threads


def start_runtime(device: str, cpu_devices: int = 8, compile_cache_dir: str | None = None) -> str:
    """Choose the PJRT device before the runtime starts; return "TPU" or "CPU".

    device: "tpu" (fail loudly when this VM has no TPU), "cpu" (a virtual mesh of
    `cpu_devices` CPU devices), or "auto" (PJRT_DEVICE if set, else TPU when one is attached).
    compile_cache_dir: the persistent compilation cache's directory on a TPU, or None (off;
    compile_cache.local_dir decides); the CPU runtime is never given one.
    """
    device, has_tpu = _resolve_device(device)
    if device == "tpu":
        if not has_tpu:
            raise NoTPUError(
                "a TPU run was asked for (--run.device tpu or PJRT_DEVICE=TPU) but this machine "
                f"has no TPU chips (libtpu found: {bool(torch_xla._found_libtpu)}). Run on a TPU VM, "
                "or pass --run.device cpu to train on a virtual CPU mesh.")
        xr.set_device_type("TPU")
        if compile_cache_dir and not _spmd_on:
            xr.initialize_cache(os.path.expanduser(compile_cache_dir), readonly=False)
    elif device == "cpu":
        os.environ.setdefault("CPU_NUM_DEVICES", str(cpu_devices))
        size_cpu_client_pool(int(os.environ["CPU_NUM_DEVICES"]))
        xr.set_device_type("CPU")
    else:
        raise ValueError(f"run.device must be auto, tpu or cpu, got {device!r}")
    init_spmd()
    return xr.device_type()


def _resolve_device(device: str) -> tuple[str, bool]:
    """(device with "auto" resolved as start_runtime does, whether TPU chips are attached)."""
    from torch_xla._internal import tpu

    has_tpu = bool(torch_xla._found_libtpu) and tpu.num_available_chips() > 0
    if device == "auto":
        device = os.environ.get("PJRT_DEVICE", "TPU" if has_tpu else "CPU").lower()
    return device, has_tpu


def accelerator_type(device: str) -> str:
    """What this host compiles for, known before the runtime starts (the compile cache's key):
    the TPU's accelerator type from the VM's metadata (e.g. v4-64), "tpu" if that cannot be read,
    or "cpu"."""
    device, has_tpu = _resolve_device(device)
    if device != "tpu" or not has_tpu:
        return device
    from torch_xla._internal import tpu

    try:
        return str(tpu.get_tpu_env()["ACCELERATOR_TYPE"])
    except Exception:  # noqa: BLE001 - no metadata server: still a usable (coarser) key
        return "tpu"


def init_spmd() -> None:
    """Switch the process to SPMD mode (once, before any XLA tensor exists)."""
    global _spmd_on
    if not _spmd_on:
        xr.use_spmd()
        _spmd_on = True


def device() -> torch.device:
    return torch_xla.device()


def device_counts() -> tuple[int, int]:
    """(devices in the whole slice, devices attached to this host)."""
    return xr.global_runtime_device_count(), xr.addressable_runtime_device_count()


def process_index() -> int:
    simulated = _simulated_slice()
    return simulated[0] if simulated else xr.process_index()


def process_count() -> int:
    simulated = _simulated_slice()
    return simulated[1] if simulated else xr.process_count()


def is_main_process() -> bool:
    return process_index() == 0


def data_split() -> tuple[int, int]:
    """(index, count) of the part of each global batch that this process's devices hold and
    read: its host's share on a slice; everything in a simulated slice."""
    return (0, 1) if _simulated_slice() else (process_index(), process_count())


@dataclass(frozen=True)
class DeviceLayout:
    """Which devices each host owns: `hosts[p]` are host p's device ids (the mesh ids, i.e. the
    runtime's global ordinals) in the order its runtime lists its addressable devices, the order
    in which a minibatch upload fills them. The mesh is their concatenation (host order), so host
    p's devices sit at the mesh positions [start, stop) of `positions(p)`."""

    hosts: tuple[tuple[int, ...], ...]

    @classmethod
    def contiguous(cls, devices: int, hosts: int) -> DeviceLayout:
        """Host p owns ids [p·L, (p+1)·L): one host, the CPU mesh, or a slice whose ids follow
        its hosts (bench.py's hypothetical slices)."""
        if hosts < 1 or devices % hosts:
            raise ValueError(f"{devices} devices do not split over {hosts} hosts")
        per_host = devices // hosts
        return cls(tuple(tuple(range(p * per_host, (p + 1) * per_host)) for p in range(hosts)))

    @classmethod
    def parse(cls, text: str) -> DeviceLayout:
        """"0,1,4,5|2,3,6,7" -> host 0 owns 0,1,4,5, host 1 owns 2,3,6,7."""
        try:
            return cls(tuple(tuple(int(i) for i in host.split(",")) for host in text.split("|")))
        except ValueError:
            raise ValueError(f"device layout {text!r}: expected ids per host, e.g. 0,1,4,5|2,3,6,7") from None

    def problems(self, devices: int) -> list[str]:
        """What keeps this layout from being a slice of `devices` devices (each id once, every
        host the same number of devices)."""
        ids = [i for host in self.hosts for i in host]
        out = []
        if sorted(ids) != list(range(devices)):
            out.append(f"the hosts' devices {self} are not each of the ids 0..{devices - 1} once")
        if len({len(host) for host in self.hosts}) != 1:
            out.append(f"the hosts own different numbers of devices: {self}")
        return out

    def mesh_order(self) -> list[int]:
        return [i for host in self.hosts for i in host]

    def positions(self, host: int) -> tuple[int, int]:
        start = sum(len(h) for h in self.hosts[:host])
        return start, start + len(self.hosts[host])

    def row_block(self, num_rows: int, host: int) -> tuple[int, int]:
        """[start, stop) of the rows host `host`'s devices hold of a tensor split by rows over the
        mesh: XLA gives the device at position k the rows [k·c, (k+1)·c), c = ceil(num_rows /
        devices) (the last ones fewer, or none)."""
        per_device = -(-num_rows // sum(len(h) for h in self.hosts))
        first, last = self.positions(host)
        return min(num_rows, first * per_device), min(num_rows, last * per_device)

    def __str__(self) -> str:
        return " | ".join(",".join(map(str, host)) for host in self.hosts)


_layout: DeviceLayout | None = None


def local_device_ids() -> list[int]:
    """This host's device ids, in its runtime's order (see _own_device_ids)."""
    return _own_device_ids()


def _own_device_ids() -> list[int]:
    """This host's device ids as its runtime lists its addressable devices ("TPU:4" -> 4): the
    order in which a minibatch upload fills them (torch_xla's GetLocalDevices)."""
    return [int(name.rsplit(":", 1)[1]) for name in torch_xla._XLAC._xla_get_runtime_devices()]


def device_layout() -> DeviceLayout:
    """The slice's layout, gathered once from every host's runtime (after init_host_group on a
    slice of several hosts); a simulated slice takes it from SIMULATED_DEVICES_ENV."""
    global _layout
    if _layout is None:
        devices, simulated = xr.global_runtime_device_count(), _simulated_slice()
        if simulated:
            given = os.environ.get(SIMULATED_DEVICES_ENV)
            layout = DeviceLayout.parse(given) if given else DeviceLayout.contiguous(devices, simulated[1])
            if len(layout.hosts) != simulated[1]:
                raise ValueError(f"{SIMULATED_DEVICES_ENV}={given!r} lists {len(layout.hosts)} hosts, the "
                                 f"simulated slice has {simulated[1]}")
            own = list(layout.hosts[simulated[0]])
        else:
            own = _own_device_ids()
        if _group_size() != process_count():
            raise RuntimeError("the device layout needs every host: call init_host_group() first")
        layout = DeviceLayout(tuple(tuple(ids) for ids in all_gather_object(own)))
        problems = layout.problems(devices)
        if problems:
            raise RuntimeError("the hosts' devices do not form one slice: " + "; ".join(problems))
        _layout = layout
    return _layout


def row_block(num_rows: int, index: int, layout: DeviceLayout | None = None) -> tuple[int, int]:
    """[start, stop) of the rows that host `index` holds of a tensor split by rows over the mesh
    (the slice's layout unless `layout` is given)."""
    return (layout or device_layout()).row_block(num_rows, index)


def rows_here(num_rows: int) -> tuple[int, int]:
    """[start, stop) of the rows of a tensor split by rows (a batch, the carry, the puzzle table)
    that this process reads and writes: its host's block; all of them in a simulated slice, whose
    processes each run the whole program."""
    index, count = data_split()
    return (0, num_rows) if count == 1 else row_block(num_rows, index)


# -- sharding -----------------------------------------------------------------------------------


def data_mesh(layout: DeviceLayout | None = None) -> xs.Mesh:
    """One axis over all devices of the slice, in host order (`DeviceLayout`): host 0's devices,
    then host 1's, ...; on one host, the runtime's own order."""
    order = (layout or device_layout()).mesh_order()
    return xs.Mesh(np.array(order), (len(order),), ("data",))


def _batch_spec(ndim: int) -> tuple:
    return ("data",) + (None,) * (ndim - 1)


def shard_batch_dim(tensor: torch.Tensor, mesh: xs.Mesh) -> torch.Tensor:
    """Annotate an XLA tensor as split on dim 0 over the data axis (0-d tensors stay replicated)."""
    if tensor.ndim:
        xs.mark_sharding(tensor, mesh, _batch_spec(tensor.ndim))
    return tensor


def rows_to_device(cpu_tensor: torch.Tensor, mesh: xs.Mesh) -> torch.Tensor:
    """A whole CPU tensor as an XLA tensor split by rows over the mesh (each device gets only its
    rows, and each host sends only its devices' rows): the puzzle-embedding table, which would
    not fit replicated on every device. Gathers and scatters by row index on it stay local
    (XLA's partitioner masks each device's lookups and sums them across devices)."""
    spec = xs.ShardingSpec(mesh, _batch_spec(cpu_tensor.ndim)).xla_spec(cpu_tensor)
    return torch_xla._XLAC._xla_tensors_from_aten([cpu_tensor.contiguous()], [str(device())], [spec])[0]


def row_split_text(mesh: xs.Mesh) -> str:
    """The HLO sharding of a table that rows_to_device splits over the mesh, as XLA writes it
    ({devices=[N,1]...}): tpu_compile.py sets it on a traced program's table parameter."""
    return torch_xla._XLAC._get_xla_sharding_spec(rows_to_device(torch.zeros(mesh.size(), 1), mesh))


def replicate(tensor: torch.Tensor, mesh: xs.Mesh) -> torch.Tensor:
    """Annotate an XLA tensor as replicated on every device. Model state starts unannotated;
    a tensor the step writes comes back annotated "replicated", and that difference alone would
    make the second step trace a new graph."""
    xs.mark_sharding(tensor, mesh, (None,) * tensor.ndim)
    return tensor


@functools.cache
def _input_spec(mesh: xs.Mesh, ndim: int) -> xs.ShardingSpec:
    """Built once per rank, not once per step and key."""
    return xs.ShardingSpec(mesh, _batch_spec(ndim), minibatch=True)


def host_batch_to_global(host_batch: dict[str, np.ndarray | torch.Tensor], mesh: xs.Mesh) -> dict[str, torch.Tensor]:
    """Each host's rows → one global XLA tensor per key, batch-sharded over all devices.

    This host's array holds its contiguous slice of the global batch (host p of P holds rows
    [p·B/P, (p+1)·B/P)); with `minibatch=True` the runtime places the slice on this host's
    devices without any cross-host traffic, its i-th chunk on the i-th device the runtime lists,
    which the host-ordered mesh puts at the slice's global rows. Each key gets a spec of its own
    rank: a spec of the wrong rank would silently leave that tensor replicated. All keys go in
    one transfer call with specs built once (cheaper in host time than one
    xm.send_cpu_data_to_device per key). A simulated slice uploads every host's rows to the
    devices the simulated hosts own (`_place_like_the_runtime`).
    """
    local_devices = xr.addressable_runtime_device_count()
    tensors, shardings = [], []
    for key, array in host_batch.items():
        if array.shape[0] % local_devices:
            raise ValueError(f"host batch of {key!r} has {array.shape[0]} rows, not divisible by "
                             f"this host's {local_devices} devices")
        # CPU torch tensors as they are: numpy has no bfloat16 (a restored bf16 carry)
        cpu_tensor = (array.contiguous() if isinstance(array, torch.Tensor)
                      else torch.from_numpy(np.ascontiguousarray(array)))
        tensors.append(cpu_tensor)
        shardings.append(_input_spec(mesh, array.ndim).xla_spec(cpu_tensor))
    if _simulated_slice():
        return {key: _place_like_the_runtime(t, mesh, device_layout()) for key, t in zip(host_batch, tensors)}
    on_device = torch_xla._XLAC._xla_tensors_from_aten(tensors, [str(device())] * len(tensors), shardings)
    return dict(zip(host_batch, on_device))


def _place_like_the_runtime(global_rows: torch.Tensor, mesh: xs.Mesh, layout: DeviceLayout) -> torch.Tensor:
    """The global batch as a slice's hosts upload it with `minibatch=True` (a simulated slice,
    whose one process holds every row and every device): host p's slice is rows
    [p·B/P, (p+1)·B/P), and its i-th chunk of B/N rows goes to the i-th device it owns
    (layout.hosts[p][i]), wherever the mesh puts that device (torch_xla 2.9,
    xla_sharding_util.cpp GetShardIndicesForMinibatchTensor: chunk i of a host's tensor to its
    i-th addressable device). With a host-ordered mesh the rows land at their own global rows."""
    num_devices = len(layout.mesh_order())
    chunk = global_rows.shape[0] // num_devices
    by_device = {}
    for host, owned in enumerate(layout.hosts):
        first = layout.positions(host)[0] * chunk  # the host's slice starts here (equal hosts)
        for i, device_id in enumerate(owned):
            by_device[device_id] = global_rows[first + i * chunk:first + (i + 1) * chunk]
    op_sharding = mesh.get_op_sharding(_batch_spec(global_rows.ndim))
    shards = [by_device[i].contiguous() for i in _own_device_ids()]  # in this process's device order
    return torch_xla._XLAC._global_tensor_from_cpu_shards(shards, op_sharding, list(global_rows.shape))


def local_rows(tensor: torch.Tensor, devices: list[int] | None = None, shards=None) -> tuple[int, torch.Tensor]:
    """Rows of a batch-sharded tensor as (first global row, CPU tensor), copied from this
    process's devices only (`.cpu()` of a sharded tensor would gather from every host): all of
    them, or those of `devices` (ids; a host's devices in a simulated slice, where one process
    holds them all). They must be consecutive rows, as a host's are in the host-ordered mesh.
    `shards`: the tensor's local shards if already read (`read_local_shards`)."""
    shards = read_local_shards(tensor) if shards is None else shards
    if any(s.indices is Ellipsis for s in shards):  # a mesh of one device: nothing is split
        return 0, shards[0].data
    if devices is not None:
        shards = [s for s in shards if int(s.shard_device.rsplit(":", 1)[1]) in set(devices)]
    blocks = sorted(((s.indices[0].start, s.unpadded_data) for s in shards), key=lambda b: b[0])
    start = blocks[0][0]
    if [b[0] for b in blocks] != [start + sum(len(x) for _, x in blocks[:i]) for i in range(len(blocks))]:
        raise RuntimeError(f"the rows of devices {devices or _own_device_ids()} are not consecutive (they start at "
                           f"rows {[b[0] for b in blocks]}): the mesh does not list the devices in host order")
    return start, torch.cat([b for _, b in blocks])


def read_local_shards(tensor: torch.Tensor) -> list:
    """The shards of `tensor` on this process's devices, copied to the CPU (one device-to-host
    transfer), each with its device and its global indices."""
    from torch_xla.distributed.spmd import XLAShardedTensor

    xm.wait_device_ops()  # local shards can only be read once the computation producing them ended
    return XLAShardedTensor(tensor).local_shards


def host_rows(tensor: torch.Tensor, host: int, layout: DeviceLayout | None = None) -> tuple[int, torch.Tensor]:
    """Host `host`'s rows of a batch-sharded tensor (first global row, CPU tensor), read from its
    own devices; they must be the layout's row block of that host."""
    layout = layout or device_layout()
    start, rows = local_rows(tensor, list(layout.hosts[host]))
    expected = layout.row_block(tensor.shape[0], host)
    if (start, start + len(rows)) != expected and len(rows):
        raise RuntimeError(f"host {host}'s devices {list(layout.hosts[host])} hold rows [{start}, {start + len(rows)}) "
                           f"of {tensor.shape[0]}, not its block [{expected[0]}, {expected[1]}): the mesh does not "
                           "list the devices in host order")
    return start, rows


def local_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of a replicated tensor, read from one local device (no cross-host traffic).
    Any other sharding would make `.cpu()` run a program on every device of the slice, which
    hangs when one host reads alone (a checkpoint share): refused."""
    spec = torch_xla._XLAC._get_xla_sharding_spec(tensor)
    if spec not in ("", "{replicated}"):
        raise ValueError(f"local_copy of a tensor sharded as {spec}: only a replicated tensor can be read by "
                         "one host alone (use local_rows for a tensor split by rows)")
    return tensor.cpu()


class RowPlacementError(RuntimeError):
    """The rows a host uploads do not land on its own devices (`check_row_placement`)."""


def check_row_placement(mesh: xs.Mesh) -> float:
    """The start-up self-check of a slice (seconds it took): upload one batch whose rows hold
    their own global index, then every host reads its devices' rows back and compares them with
    what it sent; on any host's mismatch every host raises RowPlacementError naming each host's
    devices and the rows that landed there. It costs one small upload and one device-to-host read
    of local rows (one row per device)."""
    started = time.perf_counter()
    layout = device_layout()
    num_rows = len(layout.mesh_order())  # one row per device
    index, count = data_split()
    sent = (index * num_rows // count, (index + 1) * num_rows // count)  # this process's rows
    uploaded = host_batch_to_global({"row": torch.arange(*sent, dtype=torch.int32)[:, None]}, mesh)["row"]
    host = process_index()
    block = layout.row_block(num_rows, host)
    try:
        shards = read_local_shards(uploaded)  # the check's one read
        start, landed = local_rows(uploaded, shards=shards)
        own_start, own = local_rows(uploaded, list(layout.hosts[host]), shards)
        seen = f"rows {landed[:, 0].tolist()} from row {start}; its own devices rows {own[:, 0].tolist()}"
        ok = (start == sent[0] and landed[:, 0].tolist() == list(range(*sent))
              and own_start == block[0] and own[:, 0].tolist() == list(range(*block)))
    except RuntimeError as e:
        ok, seen = False, str(e)
    reports = all_gather_object((ok, f"host {host} (devices {','.join(map(str, layout.hosts[host]))}): sent rows "
                                      f"{sent[0]}..{sent[1] - 1}, its devices hold {seen}"))
    if not all(ok for ok, _ in reports):
        raise RowPlacementError(
            f"the rows each host uploads do not land on its own devices (device layout {layout}; mesh order "
            f"{','.join(map(str, mesh.device_ids))}):\n  " + "\n  ".join(line for _, line in reports)
            + "\nTraining would mix rows across hosts and checkpoints would lose rows; nothing was trained. "
            "Please report these lines (torch_xla's placement differs from the host-ordered mesh).")
    return time.perf_counter() - started


def bytes_per_device(tensor: torch.Tensor) -> int:
    """Bytes that one device holds for this XLA tensor, read from its sharding annotation (no
    copy to the host). Replicated or unannotated (SPMD places an unannotated tensor whole on
    every device): the whole tensor. Tiled ("{devices=[8,1]...}"): one tile, each dimension
    ceil(dim / tiles) long, as the runtime pads uneven tiles; tile dimensions beyond the
    tensor's own (last_tile_dim_replicate, last_tile_dims={...}) hold replicas and split nothing."""
    shape = list(tensor.shape)
    tiled = re.search(r"devices=\[([\d,]+)\]", torch_xla._XLAC._get_xla_sharding_spec(tensor))
    if tiled:
        tiles = [int(t) for t in tiled.group(1).split(",")]
        shape = [-(-size // count) for size, count in zip(shape, tiles)]
    return math.prod(shape) * tensor.element_size()


def sync() -> None:
    """Run everything traced so far as one graph (the end of a step)."""
    torch_xla.sync()


def xla_counters() -> dict:
    """Graphs compiled (and seconds), aten:: CPU fallbacks by op, device-to-host transfers, and
    the persistent compilation cache's hits, misses and failed loads (torch_xla's counters
    PersistentCacheHit / PersistentCacheMiss / PersistentCacheDeserializeFailure, runtime/cache.h;
    a counter exists once it first counts)."""
    import torch_xla.debug.metrics as met

    compile_data = met.metric_data("CompileTime")
    transfers = met.metric_data("TransferFromDeviceTime")
    return {
        "compiles": compile_data[0] if compile_data else 0,
        "compile_seconds": compile_data[1] / 1e9 if compile_data else 0.0,
        "fallbacks": {n: met.counter_value(n) for n in met.counter_names() if n.startswith("aten::")},
        "transfers": transfers[0] if transfers else 0,
        "cache_hits": met.counter_value("PersistentCacheHit") or 0,
        "cache_misses": met.counter_value("PersistentCacheMiss") or 0,
        "cache_load_failures": met.counter_value("PersistentCacheDeserializeFailure") or 0,
    }


# PJRT's device kinds, from the TPU VM's accelerator type (v4-64, v5litepod-16, v6e-8, ...).
_TPU_KINDS = {"v4": "TPU v4", "v5litepod": "TPU v5 lite", "v5e": "TPU v5 lite", "v5p": "TPU v5", "v6e": "TPU v6 lite"}


def accelerator_kind() -> str:
    """The kind of this slice's devices as PJRT names them ("TPU v4", "TPU v5 lite" for v5e,
    "TPU v6 lite" for v6e), "CPU" on the virtual mesh, or "TPU" when the generation cannot be
    told. torch_xla 2.9 answers `xm.xla_device_kind` only for a real device, and under SPMD the
    only device Python can name is the virtual one, so the generation of a TPU comes from the
    VM's accelerator type (TPU metadata) when the runtime does not say it."""
    if xr.device_type() != "TPU":
        return xr.device_type() or "CPU"
    try:
        return torch_xla._XLAC._xla_device_kind(str(device()))
    except RuntimeError:  # "Unknown device SPMD:0"
        pass
    try:
        from torch_xla._internal import tpu

        generation = tpu.get_tpu_type()
    except Exception:  # noqa: BLE001 - no metadata: the kind stays unknown (no MFU), training goes on
        return "TPU"
    return _TPU_KINDS.get(generation, f"TPU {generation}")


def memory_info() -> dict[str, int]:
    """Memory of this host's device as the runtime reports it (`xm.get_memory_info`), in bytes:
    {"used", "peak", "limit"} ("peak" absent when the runtime does not track it). Raises
    RuntimeError with the runtime's reason when it reports nothing: the CPU client has no
    allocator statistics, and torch_xla 2.9 refuses the SPMD virtual device."""
    try:
        info = xm.get_memory_info(device())
    except RuntimeError as e:  # the runtime's check message, said plainly
        message = str(e)
        if "SPMD virtual device" in message:
            raise RuntimeError("torch_xla reports no memory for the SPMD virtual device") from e
        if "GetAllocatorStats" in message:
            raise RuntimeError(f"the {xr.device_type()} client keeps no allocator statistics") from e
        raise
    out = {"used": int(info["bytes_used"]), "limit": int(info["bytes_limit"])}
    if "peak_bytes_used" in info:
        out["peak"] = int(info["peak_bytes_used"])
    return out


def start_profile(local_dir: str) -> None:
    """Start recording an XLA profile into a local directory (TensorBoard's profile plugin)."""
    import torch_xla.debug.profiler as xp

    xp.start_trace(local_dir)


def stop_profile() -> None:
    """Wait for the device to finish what was traced, then stop the profile."""
    import torch_xla.debug.profiler as xp

    xm.wait_device_ops()
    xp.stop_trace()


# -- cross-host protocol --------------------------------------------------------------------------


def init_host_group(init_method: str | None = None, rank: int | None = None, world_size: int | None = None,
                    timeout_s: float = 600) -> None:
    """A gloo process group over the hosts, for barriers and small objects (not for tensors of
    the step). On a pod it finds its peers through the TPU runtime (`xla://`); tests pass a
    tcp:// address, rank and world size. A single process needs no group.
    """
    if dist.is_initialized():
        return
    simulated = _simulated_slice()
    if init_method is None and simulated:
        rank, world_size, init_method = simulated
    if init_method is None:
        if xr.process_count() == 1:
            return
        import torch_xla.distributed.xla_backend  # noqa: F401  (registers the xla:// rendezvous)
        init_method, rank, world_size = "xla://", xr.process_index(), xr.process_count()
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


class HostLostError(RuntimeError):
    """A collective of the host group failed: another host closed its connection (it died, was
    preempted or was killed) or stopped answering."""


def _collective(fn, *args, **kwargs):
    """Run a torch.distributed collective; a broken connection to a peer raises HostLostError."""
    try:
        return fn(*args, **kwargs)
    except (RuntimeError, dist.DistError) as e:  # gloo reports a vanished peer as a RuntimeError
        raise HostLostError(f"{fn.__name__} across the hosts failed: {e}") from e


def _group_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    if _group_size() > 1:
        _collective(dist.barrier)


def broadcast_object(obj, src: int = 0):
    """Process `src`'s object on every host."""
    if _group_size() == 1:
        return obj
    box = [obj]
    _collective(dist.broadcast_object_list, box, src=src)
    return box[0]


def all_gather_object(obj) -> list:
    if _group_size() == 1:
        return [obj]
    out = [None] * _group_size()
    _collective(dist.all_gather_object, out, obj)
    return out


def any_host(flag: bool) -> bool:
    """True on every host when `flag` is true on at least one (a collective: all hosts call it)."""
    if _group_size() == 1:
        return flag
    value = torch.tensor([int(flag)])
    _collective(dist.all_reduce, value, op=dist.ReduceOp.MAX)
    return bool(value.item())


class HostMismatchError(RuntimeError):
    pass


def check_same_config(config_text: str) -> str:
    """Stop every host when any host runs a different configuration (code or flags).

    Returns the config hash. Every host raises the same error, naming the hosts that differ
    from process 0.
    """
    digest = hashlib.sha256(config_text.encode()).hexdigest()[:16]
    digests = all_gather_object(digest)
    odd = [i for i, d in enumerate(digests) if d != digests[0]]
    if odd:
        raise HostMismatchError(
            f"host(s) {odd} run a configuration whose hash differs from process 0's "
            f"({', '.join(f'host {i}: {digests[i]}' for i in odd)}; host 0: {digests[0]}). "
            "Deploy the same code and pass the same flags to every host (launch.sh deploy + train).")
    return digest
