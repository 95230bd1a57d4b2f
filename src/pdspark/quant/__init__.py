"""Quantized checkpoints (ModelSlim "ascendV1") and their pure-torch CPU reference kernels.

`scheme` reads `quant_model_description.json`; `kernels` holds the runtime math (per-token and static int8
activation quantization, `torch._int_mm`, the rescales, int4 unpacking, the int64 `deq_scale` decoding);
`quant_linear` and `quant_experts` are the modules the model runs in place of its float weights.
"""
