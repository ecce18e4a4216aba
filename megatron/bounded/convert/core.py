"""What every family shares: reading a Hugging Face ``config.json`` with refusals, the flags of a
decoder of RMSNorm, rotary attention and SwiGLU MLPs, and the tensor rules that tie the
checkpoint's keys (megatron-core's sharded keys at TP = EP = 1, i.e. the global tensors) to the
Hugging Face tensor names.

A rule is exact both ways: ``join`` builds one global tensor of ours from its Hugging Face
tensors, ``split`` gives them back unchanged (cat/stack and their slices; no arithmetic), so an
import followed by an export returns every tensor bitwise.

The layouts (megatron-core's, at tensor- and expert-parallel size 1):
* ``linear_qkv``: rows grouped by query group g: the g-th group's query heads, then its key head,
  then its value head (``[ng, (nq/ng + 2) * d, hidden]``);
* ``linear_fc1`` of a SwiGLU MLP: the gate projection's rows, then the up projection's;
* experts: ``...mlp.experts.experts.linear_fc1.weight`` is ``[E, 2F, hidden]``, expert e's fc1
  (gate then up), ``linear_fc2`` ``[E, hidden, F]`` (the global tensor of upstream's
  ``SequentialMLP`` sharding, which ``megatron.bounded.moe.experts.GroupedExperts`` shares).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch


class ConversionError(ValueError):
    """A model, option or tensor this converter does not map (the message names it and the fix)."""


def refuse(what: str, fix: str) -> ConversionError:
    return ConversionError(f"{what}; {fix}")


class HFConfig:
    """A ``config.json`` as read, with the checks every mapping makes of it."""

    def __init__(self, values: dict, family: str):
        self.values = values
        self.family = family

    def __getitem__(self, key: str):
        if key not in self.values:
            raise refuse(f"config.json of this {self.family} model has no '{key}'",
                         "the converter needs it: check that the directory holds the model's own "
                         "config.json")
        return self.values[key]

    def either(self, *keys: str):
        """The value of the first of ``keys`` present (names that differ between versions)."""
        for key in keys:
            if self.values.get(key) is not None:
                return self.values[key]
        return self[keys[0]]

    def get(self, key: str, default=None):
        value = self.values.get(key, default)
        return default if value is None else value

    def require(self, key: str, allowed: Sequence, default=None, why: str = "") -> None:
        """Refuse a value of ``key`` outside ``allowed`` (``default`` when absent)."""
        value = self.values.get(key, default)
        if value not in allowed:
            shown = " or ".join(repr(v) for v in allowed)
            raise refuse(f"config.json sets {key} = {value!r}, which the {self.family} mapping "
                         f"does not convert (it converts {shown}{why})",
                         "convert a model without it, or add its mapping in "
                         f"megatron/bounded/convert/{self.family}.py")

    def head_dim(self) -> int:
        return int(self.get("head_dim") or self["hidden_size"] // self["num_attention_heads"])

    def rope(self) -> tuple[float, float]:
        """(rope theta, fraction of each head that rotates). Only plain rotary embeddings are
        mapped: any scaling kind (yarn, llama3, dynamic, ...) is refused by name."""
        parameters = dict(self.values.get("rope_parameters") or {})
        legacy = self.values.get("rope_scaling")
        if legacy:
            parameters = {**legacy, **parameters}
        kind = parameters.get("rope_type", parameters.get("type", "default"))
        if kind != "default":
            raise refuse(f"config.json asks for rope scaling of kind {kind!r} (rope_parameters/"
                         "rope_scaling), which the converter does not map",
                         "convert a model with plain rotary embeddings (rope_type 'default')")
        theta = parameters.get("rope_theta", self.values.get("rope_theta", 10000.0))
        if float(theta) != int(theta):
            raise refuse(f"rope_theta = {theta} is not an integer (--rotary-base takes one)",
                         "convert a model whose rope_theta is a whole number")
        partial = parameters.get("partial_rotary_factor",
                                 self.values.get("partial_rotary_factor", 1.0))
        return float(theta), float(partial)


def decoder_flags(config: HFConfig, *, vocab_size: int, qk_norm: bool, qkv_bias: bool) -> list:
    """Flags of the attention, norms, embeddings and positions every family here shares."""
    config.require("hidden_act", ("silu",), default="silu", why=" (SwiGLU)")
    theta, partial = config.rope()
    heads, groups = config["num_attention_heads"], config.get("num_key_value_heads")
    groups = groups or heads
    flags = [
        "--num-layers", config["num_hidden_layers"], "--hidden-size", config["hidden_size"],
        "--num-attention-heads", heads, "--kv-channels", config.head_dim(),
        "--max-position-embeddings", config["max_position_embeddings"],
        "--position-embedding-type", "rope", "--rotary-base", int(theta),
        "--normalization", "RMSNorm", "--norm-epsilon", config["rms_norm_eps"],
        "--swiglu", "--disable-bias-linear", "--padded-vocab-size", vocab_size,
        "--attention-dropout", config.get("attention_dropout", 0.0), "--hidden-dropout", 0,
    ]
    if groups != heads:
        flags += ["--group-query-attention", "--num-query-groups", groups]
    if partial != 1.0:
        flags += ["--rotary-percent", partial]
    if qk_norm:
        flags += ["--qk-layernorm"]
    if qkv_bias:
        flags += ["--add-qkv-bias"]
    if not config.get("tie_word_embeddings", False):
        flags += ["--untie-embeddings-and-output-weights"]
    return [str(flag) for flag in flags]


def moe_layer_pattern(dense_layers: set, num_layers: int) -> list:
    """``--moe-layer-freq`` for the layers that are MoE (1) or dense (0)."""
    if not dense_layers:
        return []
    pattern = "[" + ",".join("0" if i in dense_layers else "1" for i in range(num_layers)) + "]"
    return ["--moe-layer-freq", pattern]


@dataclass(frozen=True)
class Rule:
    """One global tensor of ours (``key``) and the Hugging Face tensors it is made of."""

    key: str
    hf_names: tuple
    join: Callable  # list of tensors (in hf_names order) -> our tensor
    split: Callable  # our tensor -> list of tensors (in hf_names order)


def same(key: str, hf_name: str) -> Rule:
    return Rule(key, (hf_name,), lambda tensors: tensors[0], lambda tensor: [tensor])


def concatenated(key: str, hf_names: Sequence[str]) -> Rule:
    """Ours is the Hugging Face tensors one after the other along dim 0 (fc1: gate, then up)."""
    names = tuple(hf_names)

    def split(tensor):
        return list(torch.split(tensor, tensor.shape[0] // len(names)))

    return Rule(key, names, lambda tensors: torch.cat(tensors), split)


def grouped_qkv(key: str, q: str, k: str, v: str, heads: int, groups: int, head_dim: int) -> Rule:
    """megatron-core's fused QKV (weight or bias): per query group, its query heads, key, value."""
    per_group = heads // groups

    def join(tensors):
        query, key_, value = tensors
        rest = query.shape[1:]
        return torch.cat([query.reshape(groups, per_group * head_dim, *rest),
                          key_.reshape(groups, head_dim, *rest),
                          value.reshape(groups, head_dim, *rest)], dim=1).reshape(-1, *rest)

    def split(tensor):
        rest = tensor.shape[1:]
        grouped = tensor.reshape(groups, (per_group + 2) * head_dim, *rest)
        query, key_, value = torch.split(grouped, [per_group * head_dim, head_dim, head_dim], 1)
        return [query.reshape(-1, *rest), key_.reshape(-1, *rest), value.reshape(-1, *rest)]

    return Rule(key, (q, k, v), join, split)


def stacked_experts(key: str, per_expert: Sequence[str], num_experts: int) -> Rule:
    """``[E, ...]`` of ours from per-expert tensors: ``per_expert`` holds the name patterns (with
    ``{e}``) whose tensors are concatenated along dim 0 for each expert (fc1: gate, up)."""
    patterns = tuple(per_expert)
    names = tuple(p.format(e=e) for e in range(num_experts) for p in patterns)
    width = len(patterns)

    def join(tensors):
        return torch.stack([torch.cat(tensors[e * width:(e + 1) * width])
                            for e in range(num_experts)])

    def split(tensor):
        return [part for expert in tensor
                for part in torch.split(expert, expert.shape[0] // width)]

    return Rule(key, names, join, split)


@dataclass(frozen=True)
class DecoderNames:
    """Where a family keeps a layer's tensors (Hugging Face names below ``model.layers.{i}.``)."""

    router: str = "mlp.gate.weight"
    expert: str = "mlp.experts.{e}.{proj}.weight"  # proj: gate / up / down below
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    expert_bias: Optional[str] = None
    shared_expert: Optional[str] = None  # e.g. "mlp.shared_experts"


def attention_rules(config: HFConfig, layer: int, *, qk_norm: bool, qkv_bias: bool) -> list:
    ours, hf = f"decoder.layers.{layer}.self_attention.", f"model.layers.{layer}.self_attn."
    heads = config["num_attention_heads"]
    groups = config.get("num_key_value_heads") or heads
    shape = dict(heads=heads, groups=groups, head_dim=config.head_dim())
    rules = [
        same(f"{ours}linear_qkv.layer_norm_weight", f"model.layers.{layer}.input_layernorm.weight"),
        grouped_qkv(f"{ours}linear_qkv.weight", *(f"{hf}{p}_proj.weight" for p in "qkv"), **shape),
        same(f"{ours}linear_proj.weight", f"{hf}o_proj.weight"),
    ]
    if qkv_bias:
        rules.append(grouped_qkv(f"{ours}linear_qkv.bias", *(f"{hf}{p}_proj.bias" for p in "qkv"),
                                 **shape))
    if qk_norm:
        rules += [same(f"{ours}q_layernorm.weight", f"{hf}q_norm.weight"),
                  same(f"{ours}k_layernorm.weight", f"{hf}k_norm.weight")]
    return rules


def dense_mlp_rules(layer: int, names: DecoderNames) -> list:
    ours, hf = f"decoder.layers.{layer}.mlp.", f"model.layers.{layer}.mlp."
    return [
        same(f"{ours}linear_fc1.layer_norm_weight",
             f"model.layers.{layer}.post_attention_layernorm.weight"),
        concatenated(f"{ours}linear_fc1.weight",
                     [f"{hf}{names.gate}.weight", f"{hf}{names.up}.weight"]),
        same(f"{ours}linear_fc2.weight", f"{hf}{names.down}.weight"),
    ]


def moe_rules(layer: int, names: DecoderNames, num_experts: int) -> list:
    ours, hf = f"decoder.layers.{layer}.mlp.", f"model.layers.{layer}."
    expert = hf + names.expert.replace("{proj}", "{proj_}")
    rules = [
        same(f"{ours}linear_fc1.layer_norm_weight", f"{hf}post_attention_layernorm.weight"),
        same(f"{ours}router.weight", hf + names.router),
        stacked_experts(f"{ours}experts.experts.linear_fc1.weight",
                        [expert.replace("{proj_}", names.gate), expert.replace("{proj_}", names.up)],
                        num_experts),
        stacked_experts(f"{ours}experts.experts.linear_fc2.weight",
                        [expert.replace("{proj_}", names.down)], num_experts),
    ]
    if names.expert_bias:
        rules.append(same(f"{ours}router.expert_bias", hf + names.expert_bias))
    if names.shared_expert:
        shared = f"{hf}{names.shared_expert}."
        rules += [concatenated(f"{ours}shared_experts.linear_fc1.weight",
                               [f"{shared}{names.gate}.weight", f"{shared}{names.up}.weight"]),
                  same(f"{ours}shared_experts.linear_fc2.weight", f"{shared}{names.down}.weight")]
    return rules


def model_rules(config: HFConfig, layer_rules: Callable[[int], list]) -> list:
    """The embedding, every layer's rules (``layer_rules(i)``), the final norm and the output."""
    rules = [same("embedding.word_embeddings.weight", "model.embed_tokens.weight")]
    for layer in range(config["num_hidden_layers"]):
        rules += layer_rules(layer)
    rules.append(same("decoder.final_layernorm.weight", "model.norm.weight"))
    if not config.get("tie_word_embeddings", False):
        rules.append(same("output_layer.weight", "lm_head.weight"))
    return rules
