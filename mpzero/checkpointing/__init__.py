"""Layout-independent sharded checkpoints (torch.distributed.checkpoint) in Megatron's directory layout."""

from mpzero.checkpointing.checkpoint import check_save_directory, load_checkpoint, save_checkpoint, write_unpublished
from mpzero.checkpointing.consolidated import load_whole
from mpzero.checkpointing.format import FORMAT, LATEST, checkpoint_dir, checkpoint_key, parse_checkpoint_key
from mpzero.checkpointing.meta import check_shard_files, latest_iteration, read_dcp_metadata, read_meta
from mpzero.checkpointing.reader import ADMITTED, CheckpointReader
from mpzero.checkpointing.sharding import ChunksLoadPlanner

__all__ = ["ADMITTED", "CheckpointReader", "ChunksLoadPlanner", "FORMAT", "LATEST", "check_save_directory",
           "check_shard_files", "checkpoint_dir", "checkpoint_key", "latest_iteration", "load_checkpoint", "load_whole",
           "parse_checkpoint_key", "read_dcp_metadata", "read_meta", "save_checkpoint", "write_unpublished"]
