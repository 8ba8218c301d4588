"""A STAND-IN for an SGLang Llama (SGLang cannot be installed on these CPU machines: its
wheel pins a CUDA torch and CUDA kernels). Not SGLang's code: modules that keep the
interfaces SGLang 0.5.23 documents and implements for its unquantized layers, as read
from its source (``sglang/srt/layers/linear.py``, ``vocab_parallel_embedding.py``,
``model_loader/weight_utils.py``, ``models/llama.py``):

- every parameter is a plain ``nn.Parameter`` whose ``weight_loader`` attribute (set
  by ``set_weight_attrs``, with ``output_dim``/``input_dim``) is its layer's bound
  ``weight_loader(param, loaded_weight[, loaded_shard_id])``; a norm has none, and
  ``load_weights`` falls back to ``default_weight_loader`` (assert the size, copy);
- ``QKVParallelLinear`` (shard ids ``"q"``, ``"k"``, ``"v"``; KV heads replicated over
  ranks when there are fewer than ranks), ``MergedColumnParallelLinear`` (shard ids 0,
  1), ``RowParallelLinear`` (the input dim split), ``VocabParallelEmbedding`` and
  ``ParallelLMHead`` (the vocabulary padded to a multiple of 64, split by rows, the
  padding rows left as they are);
- ``LlamaForCausalLM.load_weights`` is SGLang's ``_legacy_load_weights`` loop (the
  stacked ``(".qkv_proj", ".q_proj", "q")`` ... mapping, ``param.weight_loader``,
  ``getattr(param, "weight_loader", default_weight_loader)``), minus the branches for
  quantized, pipelined and vision checkpoints.

The TP rank and size are given (SGLang reads them from its process groups).
"""

from __future__ import annotations

import torch
from torch import nn

PAD = 64  # SGLang's DEFAULT_VOCAB_PADDING_SIZE


def set_weight_attrs(param, attrs: dict) -> None:
    for key, value in attrs.items():
        setattr(param, key, value)


def default_weight_loader(param, loaded_weight) -> None:
    if param.numel() == 1 and loaded_weight.numel() == 1:
        param.data.fill_(loaded_weight.item())
    else:
        assert param.size() == loaded_weight.size()
        param.data.copy_(loaded_weight)


class _Linear(nn.Module):
    def __init__(self, rows: int, cols: int, rank: int, world: int):
        super().__init__()
        self.tp_rank, self.tp_size = rank, world
        self.weight = nn.Parameter(torch.zeros(rows, cols), requires_grad=False)
        set_weight_attrs(self.weight, {"input_dim": 1, "output_dim": 0, "weight_loader": self.weight_loader})


class QKVParallelLinear(_Linear):
    def __init__(self, hidden: int, head_size: int, heads: int, kv_heads: int, rank: int, world: int):
        self.head_size, self.num_heads = head_size, heads // world
        self.num_kv_heads = max(1, kv_heads // world)
        self.num_kv_head_replicas = max(1, world // kv_heads)
        super().__init__((self.num_heads + 2 * self.num_kv_heads) * head_size, hidden, rank, world)

    def weight_loader(self, param, loaded_weight, loaded_shard_id=None):
        q, kv = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[loaded_shard_id]
        shard_rank = self.tp_rank if loaded_shard_id == "q" else self.tp_rank // self.num_kv_head_replicas
        param_data = param.data.narrow(param.output_dim, offset, size)
        loaded_weight = loaded_weight.narrow(param.output_dim, shard_rank * size, size)
        assert param_data.shape == loaded_weight.shape
        param_data.copy_(loaded_weight)


class MergedColumnParallelLinear(_Linear):
    def __init__(self, hidden: int, output_sizes: list, rank: int, world: int):
        self.output_sizes = output_sizes
        super().__init__(sum(output_sizes) // world, hidden, rank, world)

    def weight_loader(self, param, loaded_weight, loaded_shard_id=None):
        offset = sum(self.output_sizes[:loaded_shard_id]) // self.tp_size
        size = self.output_sizes[loaded_shard_id] // self.tp_size
        param_data = param.data.narrow(param.output_dim, offset, size)
        loaded_weight = loaded_weight.narrow(param.output_dim, self.tp_rank * size, size)
        assert param_data.shape == loaded_weight.shape
        param_data.copy_(loaded_weight)


class RowParallelLinear(_Linear):
    def __init__(self, inputs: int, outputs: int, rank: int, world: int):
        super().__init__(outputs, inputs // world, rank, world)

    def weight_loader(self, param, loaded_weight):
        size = param.data.shape[param.input_dim]
        loaded_weight = loaded_weight.narrow(param.input_dim, self.tp_rank * size, size)
        assert param.data.shape == loaded_weight.shape
        param.data.copy_(loaded_weight)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, rank: int, world: int):
        super().__init__()
        per = -(-vocab // PAD) * PAD // world
        self.start, self.end = rank * per, min((rank + 1) * per, vocab)
        self.weight = nn.Parameter(torch.zeros(per, hidden), requires_grad=False)
        set_weight_attrs(self.weight, {"output_dim": 0, "weight_loader": self.weight_loader})

    def weight_loader(self, param, loaded_weight):
        shard = loaded_weight.narrow(param.output_dim, self.start, self.end - self.start)
        param.data[:shard.shape[0]].copy_(shard)


class ParallelLMHead(VocabParallelEmbedding):
    pass


class RMSNorm(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)


class Attention(nn.Module):
    def __init__(self, c, rank, world):
        super().__init__()
        head = c.hidden_size // c.num_attention_heads
        self.qkv_proj = QKVParallelLinear(c.hidden_size, head, c.num_attention_heads, c.num_key_value_heads,
                                          rank, world)
        self.o_proj = RowParallelLinear(c.hidden_size, c.hidden_size, rank, world)


class MLP(nn.Module):
    def __init__(self, c, rank, world):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(c.hidden_size, [c.intermediate_size] * 2, rank, world)
        self.down_proj = RowParallelLinear(c.intermediate_size, c.hidden_size, rank, world)


class DecoderLayer(nn.Module):
    def __init__(self, c, rank, world):
        super().__init__()
        self.self_attn, self.mlp = Attention(c, rank, world), MLP(c, rank, world)
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(c.hidden_size), RMSNorm(c.hidden_size)


class LlamaModel(nn.Module):
    def __init__(self, c, rank, world):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size, rank, world)
        self.layers = nn.ModuleList(DecoderLayer(c, rank, world) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config, rank: int = 0, world: int = 1):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, rank, world)
        self.lm_head = self.model.embed_tokens if config.tie_word_embeddings else \
            ParallelLMHead(config.vocab_size, config.hidden_size, rank, world)

    def load_weights(self, weights):
        stacked_params_mapping = [
            (".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
            (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1),
        ]
        params_dict = dict(self.named_parameters())
        for name, loaded_weight in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if self.config.tie_word_embeddings and "lm_head.weight" in name:
                continue
            for param_name, weight_name, shard_id in stacked_params_mapping:
                if weight_name not in name:
                    continue
                name = name.replace(weight_name, param_name)
                if name not in params_dict:
                    continue
                param = params_dict[name]
                param.weight_loader(param, loaded_weight, shard_id)
                break
            else:
                if name in params_dict:
                    param = params_dict[name]
                    getattr(param, "weight_loader", default_weight_loader)(param, loaded_weight)


def hf_weights(config, seed: int) -> dict:
    """A transformers Llama's state dict (HF names) for ``config``."""
    from transformers import LlamaConfig, LlamaForCausalLM as HF

    torch.manual_seed(seed)
    return {k: v.contiguous() for k, v in HF(LlamaConfig(**config)).state_dict().items()}
