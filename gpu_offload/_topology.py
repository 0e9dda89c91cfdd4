"""Where host memory sits next to the GPUs: each GPU's NUMA node, from its PCI device's `numa_node` in sysfs.

Copies between a GPU and host memory on the other socket run at a fraction of the link's speed, so the arena
places the slabs that serve a GPU on that GPU's node. `GPU_OFFLOAD_SYSFS_ROOT` points the reader at another
folder laid out like /sys (tests, and machines whose sysfs is mounted elsewhere).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Iterable, Optional

from . import _fork

logger = logging.getLogger("gpu_offload")

UNKNOWN = -1
_nodes: dict[int, int] = {}  # CUDA device index -> NUMA node (UNKNOWN), read once per process
_lock = _fork.new_lock()


def sysfs_root() -> str:
    return os.environ.get("GPU_OFFLOAD_SYSFS_ROOT") or "/sys"


def pci_address(index: int) -> Optional[str]:
    """The CUDA device's PCI address as sysfs names it (0000:3b:00.0); None when the driver does not say.

    From torch's device properties; a torch without the PCI fields is matched by the GPU's UUID against the
    NVIDIA driver's /proc/driver/nvidia/gpus/<address>/information."""
    try:
        import torch

        props: Any = torch.cuda.get_device_properties(index)
    except Exception:  # no CUDA: the node is unknown
        return None
    ids = [getattr(props, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if all(isinstance(v, int) for v in ids):
        return f"{ids[0]:04x}:{ids[1]:02x}:{ids[2]:02x}.0"
    uuid = str(getattr(props, "uuid", "") or "").lower().removeprefix("gpu-")
    root = "/proc/driver/nvidia/gpus"
    try:
        for address in os.listdir(root):
            with open(os.path.join(root, address, "information")) as f:
                if uuid and uuid in f.read().lower():
                    return address.lower()
    except OSError:
        pass
    return None


def read_numa_node(address: Optional[str]) -> tuple[int, str]:
    """The NUMA node sysfs gives the PCI device, and why not when it gives none."""
    if address is None:
        return UNKNOWN, "the driver gave no PCI address"
    path = os.path.join(sysfs_root(), "bus", "pci", "devices", address, "numa_node")
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError as exc:
        return UNKNOWN, f"{path}: {exc.strerror or exc}"
    try:
        node = int(text)
    except ValueError:
        return UNKNOWN, f"{path} reads {text!r}"
    if node < 0:
        return UNKNOWN, f"{path} reads {node} (the firmware does not say)"
    return node, ""


def online_nodes() -> list[int]:
    """The machine's NUMA nodes with memory (sysfs devices/system/node/has_memory, else online); [0] when
    sysfs does not say."""
    for name in ("has_memory", "online"):
        try:
            with open(os.path.join(sysfs_root(), "devices", "system", "node", name)) as f:
                text = f.read().strip()
        except OSError:
            continue
        nodes: list[int] = []
        try:
            for part in filter(None, text.split(",")):
                lo, _, hi = part.partition("-")
                nodes.extend(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            continue
        if nodes:
            return nodes
    return [0]


def gpu_numa_node(index: int) -> int:
    """GPU `index`'s NUMA node (UNKNOWN when sysfs does not say: logged once per GPU)."""
    node = _nodes.get(index)
    if node is not None:
        return node
    with _lock:
        if index not in _nodes:
            node, why = read_numa_node(pci_address(index))
            if node == UNKNOWN:
                # Where there is only one node nothing is lost; where there are more, copies may cross sockets.
                level = logging.WARNING if len(online_nodes()) > 1 else logging.INFO
                logger.log(level, "cuda:%d: NUMA node unknown (%s); its arena slabs are not placed on a node", index, why)
            _nodes[index] = node
        return _nodes[index]


def numa_node_for(devices: Iterable[Any]) -> int:
    """The node a region for these devices should be on: the first CUDA device's; UNKNOWN for none."""
    for d in devices:
        if getattr(d, "type", None) == "cuda":
            if d.index is None:
                import torch

                try:
                    index = torch.cuda.current_device()
                except Exception:  # no CUDA here (a file saved on a GPU, loaded on a CPU machine)
                    return UNKNOWN
                return gpu_numa_node(index)
            return gpu_numa_node(int(d.index))
    return UNKNOWN


def clear_cache() -> None:
    """Forgets the nodes read so far (tests that change GPU_OFFLOAD_SYSFS_ROOT)."""
    with _lock:
        _nodes.clear()
