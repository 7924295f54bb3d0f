"""Layout-independent sharded checkpoints (torch.distributed.checkpoint) in Megatron's directory layout."""

from mpzero.checkpointing.checkpoint import (checkpoint_dir, latest_iteration, load_checkpoint, save_checkpoint,
                                             write_unpublished)

__all__ = ["checkpoint_dir", "latest_iteration", "load_checkpoint", "save_checkpoint", "write_unpublished"]
