"""mpzero/scale.py: sizes no machine holds are one line from the planner's arithmetic before anything is built (issue
42, item 2). Every flag that sizes what a rank holds (the parts `parameters_per_rank` and the activation formula
count), set to 10**12 on the tiny run: exit 2, one line naming the part that does not fit, within seconds (no
construction, no allocator traceback). And the figure is a lower bound: the model states ZeroOptimizer really
allocates for a run that fits are at least what check_scale counts for them."""

import time

import pytest

from mpzero.scale import LAYER_OBJECT_BYTES, check_scale, parameters_per_rank
from mpzero.errors import ConfigError
from mpzero.models import GPTConfig
from tests.cli import TINY, exit_code_and_stderr
from tests.distributed import run_ranks

HUGE = str(10 ** 12)
SIZES = {  # flag(s) set to 10**12: the part the line must name
    "--num-layers": (["--num-layers", HUGE], "layers"),
    "--hidden-size": (["--hidden-size", HUGE, "--num-attention-heads", "4"], "layers"),
    "--ffn-hidden-size": (["--ffn-hidden-size", HUGE], "layers"),
    "--vocab-size": (["--vocab-size", HUGE], "vocabulary"),
    "--make-vocab-size-divisible-by": (["--make-vocab-size-divisible-by", HUGE], "vocabulary"),
    "--max-position-embeddings": (["--max-position-embeddings", HUGE], "positions"),
    "--seq-length": (["--seq-length", HUGE, "--max-position-embeddings", HUGE], "positions"),
    "--micro-batch-size": (["--micro-batch-size", HUGE, "--global-batch-size", HUGE], "activations"),
}


def _timed(argv):
    start = time.monotonic()
    code, stderr = exit_code_and_stderr(argv)
    return code, stderr, time.monotonic() - start


@pytest.mark.parametrize("flag", sorted(SIZES))
def test_a_size_no_machine_holds_is_one_line_before_anything_is_built(flag):
    extra, part = SIZES[flag]
    code, stderr, seconds = run_ranks(1, _timed, TINY + ["--eval-iters", "0"] + extra)[0]
    assert code == 2 and stderr.count("\n") == 1, stderr
    assert stderr.startswith("error: this run needs at least ") and f"most of it is the {part}; check" in stderr, stderr
    assert seconds < 30, f"{flag}: {seconds:.0f} s"


def test_the_figure_is_a_lower_bound_of_what_a_run_holds():
    """GPT-2 124M's shapes: the counted parameters are at most the real ones (the norms' and biases' left out), and
    what fits is never refused."""
    config = GPTConfig(num_layers=12, hidden_size=768, num_attention_heads=12, vocab_size=50257,
                       max_position_embeddings=1024)
    counted = sum(parameters_per_rank(config, 1).values())
    real = 124_439_808 + (50304 - 50257) * 768  # GPT2LMHeadModel's (tied), mpzero's vocabulary padded to 50304
    assert real - 121_344 == counted  # less the biases and norms: 12 x (2304 + 768 + 3072 + 768 + 4 x 768) + 1536
    check_scale(config, 1, 1, 1, (4, 4, 0, 8), lambda: 0, {"host memory": counted * 16 + 12 * LAYER_OBJECT_BYTES})
    with pytest.raises(ConfigError, match="most of it is the layers"):
        check_scale(config, 1, 1, 1, (4, 4, 0, 8), lambda: 0, {"host memory": counted * 15})
