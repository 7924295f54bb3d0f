"""Layout-independent sharded checkpoints (torch.distributed.checkpoint) in Megatron's directory layout."""

from mpzero.checkpointing.checkpoint import check_save_directory, load_checkpoint, save_checkpoint, write_unpublished
from mpzero.checkpointing.format import FORMAT, LATEST, checkpoint_dir, checkpoint_key, parse_checkpoint_key
from mpzero.checkpointing.meta import latest_iteration, read_meta

__all__ = ["FORMAT", "LATEST", "check_save_directory", "checkpoint_dir", "read_meta", "checkpoint_key", "latest_iteration",
           "load_checkpoint", "parse_checkpoint_key", "save_checkpoint", "write_unpublished"]
