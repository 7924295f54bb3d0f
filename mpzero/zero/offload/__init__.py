"""Offload tiers for ZeRO model states (ZeRO-Offload, ZeRO-Infinity): host memory and disk. A part of ZeRO: the
contract the tiers share with the stages (`ParamSink`, `TierBytes`, `Transfers`, `OffloadHolder`) is ZeRO's own,
`mpzero/zero/tiers.py`; ZeRO imports this package only where a run asks for a tier.

- `swap`: aligned buffers and files read and written with O_DIRECT where the file system allows it.
- `directory`: each rank's private, locked folder of swap files under --offload-path.
- `masters`: the offloaded `MasterStore`s (fp32 masters and the rule's states in host memory or on disk).
- `sizing`: the offloaded optimizer's host buffers, sized from the settings (also for the planner).
- `params`: stage 3's parameter shards in host memory or on disk.
- `grad_file`: the gradient partition on disk beside a disk optimizer (stages 2-3).
"""

from mpzero.zero.offload.directory import SWAP_NAMES, OffloadDirectory, open_offload_directory
from mpzero.zero.offload.grad_file import GradFile, RegionReader, gradient_file, gradient_file_bytes
from mpzero.zero.offload.masters import OffloadedMasters
from mpzero.zero.offload.params import SLOTS, ParamTier
from mpzero.zero.offload.sizing import buffer_bytes, round_to_block
from mpzero.zero.offload.swap import (ALIGN, SwapFile, SwapPipeline, aligned_bytes, aligned_empty, disk_error_message,
                                      readable, round_up)

__all__ = ["ALIGN", "GradFile", "OffloadDirectory", "OffloadedMasters", "ParamTier", "RegionReader", "SLOTS",
           "SWAP_NAMES", "SwapFile", "SwapPipeline", "aligned_bytes", "aligned_empty", "buffer_bytes",
           "disk_error_message", "gradient_file", "gradient_file_bytes", "open_offload_directory", "readable",
           "round_to_block", "round_up"]
