"""`DSparkConfig`: the speculative drafter's architecture, from the `dspark` entry of a checkpoint's config.json.

```json
"dspark": {"num_stages": 2, "target_layer_ids": [1, 3, 5], "gamma": 5, "mask_token_id": 3, "markov_rank": 64,
           "intermediate_size": 256, "n_routed_experts": 0, "num_experts_per_tok": 0,
           "uses_own_vocab_modules": false}
```
`n_routed_experts` 0 means each stage has a dense SwiGLU MLP of `intermediate_size`; otherwise a score-routed MoE
(the draft never hash-routes). The draft shares the target's hidden size, heads, mHC width and sliding window.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdspark.errors import ConfigError
from pdspark.model.model_config import ModelConfig


@dataclass(frozen=True)
class DSparkConfig:
    num_stages: int
    target_layer_ids: tuple[int, ...]
    gamma: int
    mask_token_id: int
    markov_rank: int
    intermediate_size: int
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    uses_own_vocab_modules: bool = False

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ConfigError("`dspark.num_stages` must be >= 1")
        if not self.target_layer_ids:
            raise ConfigError("`dspark.target_layer_ids` must name at least one target layer")
        if self.gamma < 1:
            raise ConfigError("`dspark.gamma` must be >= 1")
        if self.markov_rank < 0:
            raise ConfigError("`dspark.markov_rank` must be >= 0")
        if self.n_routed_experts and not 0 < self.num_experts_per_tok <= self.n_routed_experts:
            raise ConfigError("`dspark.num_experts_per_tok` must be in [1, n_routed_experts]")

    def check_target(self, target: ModelConfig) -> None:
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_hidden_layers]
        if bad:
            raise ConfigError(
                f"`dspark.target_layer_ids` {bad} out of range; allowed: 0..{target.num_hidden_layers - 1}"
            )
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise ConfigError(f"`dspark.mask_token_id` must be a token id in [0, {target.vocab_size})")

    @classmethod
    def from_model_config(cls, target: ModelConfig) -> DSparkConfig | None:
        d = target.raw.get("dspark")
        if d is None:
            return None
        cfg = cls(
            num_stages=int(d["num_stages"]),
            target_layer_ids=tuple(int(i) for i in d["target_layer_ids"]),
            gamma=int(d["gamma"]),
            mask_token_id=int(d["mask_token_id"]),
            markov_rank=int(d.get("markov_rank", 0)),
            intermediate_size=int(d.get("intermediate_size", target.moe_intermediate_size)),
            n_routed_experts=int(d.get("n_routed_experts", 0)),
            num_experts_per_tok=int(d.get("num_experts_per_tok", 0)),
            uses_own_vocab_modules=bool(d.get("uses_own_vocab_modules", False)),
        )
        cfg.check_target(target)
        return cfg

    def to_dict(self) -> dict:
        return {
            "num_stages": self.num_stages,
            "target_layer_ids": list(self.target_layer_ids),
            "gamma": self.gamma,
            "mask_token_id": self.mask_token_id,
            "markov_rank": self.markov_rank,
            "intermediate_size": self.intermediate_size,
            "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "uses_own_vocab_modules": self.uses_own_vocab_modules,
        }
