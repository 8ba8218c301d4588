"""The causal LM both runners build, the probe that ties a version to its weights,
and the settings that make the probe exact on CPU.

A trainer and a rollout that build ``build(cfg)`` get the same parameter names,
shapes and dtypes, so a rollout can fetch a version straight into its own
parameters. The probe is the model's logits for a fixed prompt: the trainer
publishes it with each version, and a rollout that loaded that version recomputes
it and must get the same bits (``deterministic()`` is in force in both processes:
one thread, deterministic kernels, so the same weights give the same floats).

Architecture: a transformers Llama built from a config (seeded random init, no
download) when transformers is installed, else a plain torch decoder of the same
size. Which one ran is in ``describe()``: both sides must agree, and the rollout
checks the layout against the manifest before any byte moves.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PROBE = "probe.logits"  # the probe travels as one more (small) tensor of the version
PROMPT = [1, 7, 42, 99, 3, 250, 17, 5]


@dataclass(frozen=True)
class ModelConfig:
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    vocab: int = 2048
    seq: int = 64
    seed: int = 0
    arch: str = "auto"  # auto (llama when transformers imports), llama, torch
    # The published (and served) weights' dtype. A bfloat16 trainer keeps float32 master
    # weights and publishes them rounded, as RL trainers do: between steps most bf16
    # elements then stay the same (deltas).
    dtype: str = "float32"

    def resolved_arch(self) -> str:
        if self.arch != "auto":
            return self.arch
        try:
            import transformers  # noqa: F401
        except ImportError:
            return "torch"
        return "llama"


def deterministic() -> None:
    """Same weights, same prompt → the same logits bit for bit, in any process."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


def build(cfg: ModelConfig) -> nn.Module:
    torch.manual_seed(cfg.seed)
    arch = cfg.resolved_arch()
    if arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        conf = LlamaConfig(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.hidden * 4,
                           num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                           num_key_value_heads=cfg.heads, max_position_embeddings=max(cfg.seq, len(PROMPT)) * 2,
                           tie_word_embeddings=False, attn_implementation="eager")
        model = LlamaForCausalLM(conf)
    elif arch == "torch":
        model = TorchDecoder(cfg)
    else:
        raise ValueError(f"arch: {cfg.arch!r} is not one of auto, llama, torch")
    if cfg.dtype not in DTYPES:
        raise ValueError(f"dtype: {cfg.dtype!r} is not one of {', '.join(DTYPES)}")
    return model.to(DTYPES[cfg.dtype]).eval()


def describe(cfg: ModelConfig, model: nn.Module) -> dict:
    return {**asdict(cfg), "arch": cfg.resolved_arch(), "parameters": sum(p.numel() for p in model.parameters())}


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters as a state_dict that shares their memory (publish/fetch in place)."""
    return {name: p.detach() for name, p in model.named_parameters()}


def logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    out = model(tokens)
    return out.logits if hasattr(out, "logits") else out


@torch.no_grad()
def probe(model: nn.Module) -> torch.Tensor:
    return logits(model, torch.tensor([PROMPT])).float().contiguous()


@torch.no_grad()
def generate(model: nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy decoding, the whole sequence re-run per token (small models, no cache)."""
    tokens = list(prompt)
    for _ in range(new_tokens):
        nxt = int(logits(model, torch.tensor([tokens]))[0, -1].argmax())
        tokens.append(nxt)
    return tokens[len(prompt):]


def batch(cfg: ModelConfig, step: int, size: int = 4) -> torch.Tensor:
    """Synthetic tokens for one step, the same for a given (seed, step) everywhere."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    return torch.randint(0, cfg.vocab, (size, cfg.seq), generator=gen)


def loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    out = logits(model, tokens[:, :-1])
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), tokens[:, 1:].reshape(-1))


class TorchDecoder(nn.Module):
    """Pre-norm decoder-only transformer with a causal mask: the fallback architecture."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Embedding(max(cfg.seq, len(PROMPT)) * 2, cfg.hidden)
        layer = nn.TransformerEncoderLayer(cfg.hidden, cfg.heads, cfg.hidden * 4, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, cfg.layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        for p in self.parameters():  # a seeded init that does not depend on module order quirks
            if p.dim() > 1:
                nn.init.normal_(p, std=1 / math.sqrt(p.shape[-1]))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        x = self.embed(tokens) + self.pos(torch.arange(n))
        mask = nn.Transformer.generate_square_subsequent_mask(n)
        return self.head(self.norm(self.blocks(x, mask=mask, is_causal=True)))
