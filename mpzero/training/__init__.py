"""The training loop and its pieces. `loop.py` is the model-agnostic loop: it takes a frozen `RunConfig`
(`config.py`: typed sections, never the parsed flags) and a model provider (`provider(model_config, groups,
rng) -> BuiltModel(module, flops_per_token)`). Around it: batch order, mock data, the LR schedule, console
lines, TensorBoard, peak memory, and SIGTERM handling."""
