"""The typed configuration of a training run: one frozen section per component, resolved and validated once,
before anything is printed or built. The loop and its helpers read these sections, never the parsed flags.

`RunConfig.model` is whatever the model provider takes (a `GPTConfig` for `pretrain_gpt.py`); the loop never
looks inside it. `RunConfig.flags` is the resolved flag dictionary (flag names, derived defaults filled in),
printed at start and saved with every checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mpzero.parallel import GridSizes, ParallelGroups, init_parallel
from mpzero.pipeline import PipelineConfig
from mpzero.training.lr_schedule import LRSchedule
from mpzero.zero import OffloadConfig, OptimizerConfig, PrecisionConfig, ZeroConfig


@dataclass(frozen=True)
class ParallelConfig:
    """The grid's sizes by Megatron's flag names (data parallelism is what the world leaves) and the collectives'
    timeout."""
    tensor_model_parallel_size: int = 1
    distributed_timeout_minutes: float = 10.0
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None  # None: the TP size (Megatron's default)

    @property
    def sizes(self) -> GridSizes:
        return GridSizes(tp=self.tensor_model_parallel_size, pp=self.pipeline_model_parallel_size,
                         cp=self.context_parallel_size, ep=self.expert_model_parallel_size,
                         etp=self.expert_tensor_parallel_size)

    def join(self) -> ParallelGroups:
        """This process's groups (joining or making the default process group: `mpzero.parallel.init_parallel`)."""
        sizes = self.sizes
        return init_parallel(sizes.tp, self.distributed_timeout_minutes, pp_size=sizes.pp, cp_size=sizes.cp,
                             ep_size=sizes.ep, etp_size=sizes.etp)


@dataclass(frozen=True)
class DryRunConfig:
    """--dry-run: this process is rank `rank` of a `world_size`-rank job, run on tensors without data
    (mpzero/cli/dry_run.py); the training loop never sees it."""
    world_size: int = 1
    rank: int = 0


@dataclass(frozen=True)
class TrainingConfig:
    """check_for_nan: Megatron's --check-for-nan-in-loss-and-grad (a non-finite loss stops the run before
    the update; the gradient norm's check is the optimizer's, ZeroConfig.check_for_nan_in_grad)."""
    micro_batch_size: int
    global_batch_size: int  # resolved: micro batch size x DP size when the flag is not given
    train_iters: int
    seq_length: int
    seed: int = 1234
    exit_interval: int | None = None
    check_for_nan: bool = True
    sync_every_iteration: bool = False  # --sync-every-iteration: read the step's results every iteration


@dataclass(frozen=True)
class EvalConfig:
    eval_interval: int = 1000
    eval_iters: int = 100


@dataclass(frozen=True)
class DataConfig:
    mock_data: bool
    data_path: tuple[str, ...] | None
    split: str
    data_cache_path: str | None
    vocab_size: int  # resolved: the tokenizer's vocabulary (before padding), or --vocab-size for mock data
    tokenizer: dict | None = None  # its record (mpzero/data/tokenizer_identity.py), saved with checkpoints and
    # compared with theirs and the data's; None: not known, nothing compared
    override_tokenizer_check: bool = False  # --override-tokenizer-check: another tokenizer is a note, not an error


@dataclass(frozen=True)
class CheckpointConfig:
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    load_optim: bool = True  # False: --no-load-optim or --finetune
    load_rng: bool = True  # False: --no-load-rng or --finetune
    finetune: bool = False  # weights only, start from iteration 0
    overwrite: bool = False  # --overwrite-checkpoints: may save over --save's checkpoints without continuing them


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int = 100
    tensorboard_dir: str | None = None
    wandb_project: str | None = None  # None: no Weights & Biases run
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None  # resolved: --save/wandb, or ./wandb without --save (wandb's own default)
    wandb_entity: str | None = None


@dataclass(frozen=True)
class ProfileConfig:
    """Megatron's --profile: trace iterations (step_start, step_end] on `ranks` (mpzero/training/profiling.py),
    with torch.profiler into --tensorboard-dir (`use_pytorch_profiler`) or for Nsight Systems (CUDA only)."""
    enabled: bool = False
    use_pytorch_profiler: bool = False
    step_start: int = 10
    step_end: int = 12
    ranks: tuple[int, ...] = (0,)


@dataclass(frozen=True)
class RunConfig:
    model: Any  # the model provider's own config section
    parallel: ParallelConfig
    training: TrainingConfig
    evaluation: EvalConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    schedule: LRSchedule
    zero: ZeroConfig
    optimizer: OptimizerConfig
    precision: PrecisionConfig
    offload: OffloadConfig = OffloadConfig()
    profile: ProfileConfig = ProfileConfig()
    pipeline: PipelineConfig = PipelineConfig()
    dry_run: DryRunConfig | None = None  # None: a real run
    flags: dict = field(default_factory=dict, compare=False)
