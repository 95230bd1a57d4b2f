"""CPU step paths: a whole small step as one C call, over weight-pointer tables built once
(`hardware.cpu.kernels`).

- `decode_step.DecodeStep`: the target's layers of a decode/verify step of at most `MAX_TOKENS` tokens
  (`try_run` on a `ForwardBatch`; `try_run_indexed` with the step's indices built in C from the page tables).
- `draft_step.DraftStep`: a DSpark proposal's draft forward (`try_logits`) and its context-row writes
  (`try_inject`).

Every entry point is a `try_...` with one contract: it runs the whole step and returns its output, or returns None
where the path does not apply (other devices, weights without a C kernel (ModelSlim int8; the draft's FP8 ones), too
many tokens, positions past the rotary table...), having computed and written nothing; the caller then runs the
PyTorch modules:

    out = step.try_run(...)
    if out is None:
        out = <the module path>

A write-only step has no output: `try_inject` returns True where it wrote the rows (and None where it did not).
A path that applies runs the same steps in the same order as the modules: the decode step gives their tokens, and
logprobs within float rounding (the same bits at 1 and 2 threads, over bf16 or fp32 weight copies); the draft's
logits match to ~1e-6 of their scale (verification keeps the committed tokens the target's either way).
"""
