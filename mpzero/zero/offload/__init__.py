"""Offload tiers for ZeRO model states (ZeRO-Offload, ZeRO-Infinity): host memory and disk.

- `sink`: where a master store writes updated parameter values (device shards, or an offloaded parameter tier),
  and the per-tier byte counts every store and stage reports.
- `swap`: aligned buffers and files read and written with O_DIRECT where the file system allows it.
- `directory`: each rank's private, locked folder of swap files under --offload-path.
- `masters`: the offloaded `MasterStore`s (fp32 masters and Adam moments in host memory or on disk).
- `params`: stage 3's parameter shards in host memory or on disk.
"""
