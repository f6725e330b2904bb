"""FlashAttention benchmarks, one module per harness; the §1.3.2 section (``experiments/flash_benchmarking``)
wires them into parts and answers.

- :mod:`.sweep`: the handout's latency sweep and the timing of attention passes every harness uses.
- :mod:`.shapes`: the shapes grid against SDPA's flash and cuDNN backends.
- :mod:`.leaderboard`: the leaderboard configuration.
- :mod:`.kernels`: our kernels one by one, the autotuner's choices, and the shapes where we trail cuDNN.
- :mod:`.model`: attention inside the model's training step, and the model A/B.
- :mod:`.host`: the host's cost per call.
"""
