"""`load_checkpoint`: a DSV4 model (and its tokenizer, when shipped) from an HF-format directory."""

from __future__ import annotations

import contextlib
import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from pdspark.errors import ConfigError
from pdspark.model.compact_weights import CompactWeights
from pdspark.model.dspark import DSparkDraft
from pdspark.model.dspark_config import DSparkConfig
from pdspark.model.dspark_weights import load_draft_weights
from pdspark.model.dsv4 import DSV4Model
from pdspark.model.model_config import ModelConfig
from pdspark.model.quant_weights import QuantizedWeights
from pdspark.model.scaled_weights import Scaled
from pdspark.model.tokenizer import Tokenizer
from pdspark.model.weights import check_complete, has_scaled_weights, load_weights
from pdspark.parallel.expert_shard import ExpertShard
from pdspark.quant.scheme import DESCRIPTION_FILE, QuantDescription, is_modelslim_dir

QUANTIZATIONS = ("auto", "modelslim", "none")
# How a released checkpoint's FP8/MXFP4 weights are held: as stored ("compact": FP8/MXFP4 modules, BF16 matrices
# stay BF16; the module path with row-exact kernels), or decoded to float32 at load (the C decode step applies).
WEIGHT_FORMATS = ("compact", "float32")


@dataclass
class Checkpoint:
    model: DSV4Model
    tokenizer: Tokenizer | None
    extra: dict[str, torch.Tensor | Scaled]  # mtp.* tensors (the speculative draft; `Scaled`: kept compact)
    path: Path
    quant: QuantDescription | None = None  # a ModelSlim checkpoint's description
    compact: bool = False  # a released checkpoint's weights held as stored (`weight_format="compact"`)

    @property
    def quarot(self) -> bool:
        """A QuaRot-rotated residual stream (its embed and head are rotated)."""
        return self.quant is not None and self.quant.quarot


def load_checkpoint(
    path: str | Path, max_len: int, dtype: str = "float32", device: str = "cpu", progress: bool = False,
    quantization: str = "auto", experts: ExpertShard | None = None, weight_format: str = "compact",
    draft: bool = True,
) -> Checkpoint:
    """Load a float or ModelSlim-quantized checkpoint. `quantization`: "auto" detects a ModelSlim checkpoint by its
    `quant_model_description.json`; "modelslim" requires one; "none" reads the directory as a float checkpoint.
    `experts`: with expert parallelism, the routed experts this rank holds (the others are not read).
    `weight_format`: how a released checkpoint's FP8/MXFP4 weights are held (`WEIGHT_FORMATS`); compact, the model
    is built on the meta device and each weight gets its memory as it is read (no float copy at any point).
    `draft` False: the `mtp.*` tensors (the speculative draft) are not read."""
    path = Path(path)
    if weight_format not in WEIGHT_FORMATS:
        raise ConfigError(f"`weight_format` is {weight_format!r}; allowed: {list(WEIGHT_FORMATS)}")
    cfg = ModelConfig.from_dir(path)
    quant = quant_description(path, quantization)
    shard = experts if experts is not None else ExpertShard.whole(cfg.n_routed_experts)
    compact = CompactWeights(shard) if weight_format == "compact" and quant is None and \
        has_scaled_weights(path) else None
    model = DSV4Model(cfg, max_len, experts, meta=compact is not None)
    report = load_weights(model, path, progress=progress, quant=quant, check=quant is None and compact is None,
                          compact=compact, read_draft=draft)
    _return_freed_memory()
    quantized = None
    if quant is not None:
        assert report.quantized is not None and report.filled is not None  # load_weights sets both with `quant`
        quantized = QuantizedWeights.build(report.quantized, quant, cfg.n_routed_experts)
        check_complete(model, report.filled | quantized.filled, cfg.n_routed_experts)
    if compact is not None:
        assert report.filled is not None
        check_complete(model, report.filled | compact.filled, range(shard.first, shard.first + shard.count))
        compact.install(model)
        # The weights keep their checkpoint dtypes: only moved (a compact model computes in fp32, see
        # `DSV4Model.prepare_inference`).
        model.requires_grad_(False)
        model.eval()
        model = model.to(device=device)
        model.prepare_inference(compact=True)
        return Checkpoint(model, Tokenizer.from_dir(path, cfg.eos_token_ids), report.extra, path, quant,
                          compact=True)
    model = model.to(device=device, dtype=getattr(torch, dtype))
    if quantized is not None:
        quantized.install(model)
    # The compressor state, sinks and norms stay fp32 in DSV4; tid2eid stays integer.
    model.requires_grad_(False)
    model.eval()
    # A quantized checkpoint's module path is the reference: batch-invariant (`model/row_exact.py`).
    model.prepare_inference(row_exact=quantized is not None)
    return Checkpoint(model, Tokenizer.from_dir(path, cfg.eos_token_ids), report.extra, path, quant)


def _return_freed_memory() -> None:
    """Hand the heap memory the load's read buffers freed back to the OS (glibc keeps freed chunks of the sizes it
    saw most in its heap: a tensor's worth of each, left resident for the life of a worker otherwise). A no-op
    where there is no glibc."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def quant_description(path: Path, quantization: str) -> QuantDescription | None:
    """The checkpoint's quantization description, as `quantization` asks (see `load_checkpoint`)."""
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"`quantization` is {quantization!r}; allowed: {list(QUANTIZATIONS)}")
    if quantization == "none":
        return None
    if is_modelslim_dir(path):
        return QuantDescription.from_dir(path)
    if quantization == "modelslim":
        raise ConfigError(f"`quantization` is 'modelslim' but {path} has no {DESCRIPTION_FILE}")
    return None


def load_draft(ckpt: Checkpoint, max_len: int, dtype: str = "float32", device: str = "cpu") -> DSparkDraft:
    """The DSpark drafter shipped beside the target (`dspark` config entry, `mtp.*` tensors)."""
    dcfg = DSparkConfig.from_model_config(ckpt.model.cfg)
    if dcfg is None:
        raise ConfigError(f"{ckpt.path} has no DSpark draft (no `dspark` entry in config.json)")
    if ckpt.quarot and not dcfg.uses_own_vocab_modules:
        # The target's embed and head are rotated: a draft sharing them must have been rotated with them, as
        # ModelSlim's NPU DSpark checkpoints are, which carry their own vocab modules.
        raise ConfigError(f"{ckpt.path} is QuaRot-rotated: its DSpark draft needs its own embed and head "
                          "(`dspark.uses_own_vocab_modules: true` in config.json)")
    draft = DSparkDraft(ckpt.model.cfg, dcfg, max_len, meta=ckpt.compact)
    quantized = load_draft_weights(draft, ckpt.extra, ckpt.quant, compact=ckpt.compact)
    # A compact draft keeps its checkpoint dtypes (only moved), as its target does.
    draft = draft.to(device=device) if ckpt.compact else draft.to(device=device, dtype=getattr(torch, dtype))
    if quantized is not None:
        quantized.install(draft)
    draft.requires_grad_(False)
    draft.eval()
    draft.bind_target(ckpt.model.embed, ckpt.model.head)
    draft.prepare_inference(compact=ckpt.compact)
    return draft
