"""The parts of ``bench/gpu_lm_head_check.py`` (the LM-head paths on a GPU), by concern: ``common`` (timing, errors,
random heads and models) · ``kernels`` (head and norm kernels alone) · ``layouts`` (padded, packed and tree rows
through a model) · ``models`` (whole-model paths: fused kernels, compiled layers, device waits). Run them through
that script (it puts the repository and bench/ on ``sys.path``); its docstring says what each part measures.
"""
