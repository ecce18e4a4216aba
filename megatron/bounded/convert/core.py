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
from typing import Callable, Iterable, Optional, Sequence

import torch


class ConversionError(ValueError):
    """A model, option or tensor this converter does not map (the message names it and the fix)."""


def refuse(what: str, fix: str) -> ConversionError:
    return ConversionError(f"{what}; {fix}")


def and_more(count: int) -> str:
    """What follows the first of N + 1 names: ' (and N more)', or nothing when N = 0."""
    return f" (and {count} more)" if count else ""


class HFConfig:
    """A ``config.json`` as read (``values``: the fields of the decoder, which ``source`` names:
    the whole file, or a section of a vision-language model's), with the checks every mapping
    makes of it; ``stored``: the names of the tensors the model's files hold, for a family whose
    files may hold a tensor in more than one layout."""

    def __init__(self, values: dict, family: str, source: str = "config.json",
                 stored: Iterable[str] = ()):
        self.values = values
        self.family = family
        self.source = source
        self.stored = frozenset(stored)

    def __getitem__(self, key: str):
        if key not in self.values:
            raise refuse(f"{self.source} of this {self.family} model has no '{key}'",
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
            raise refuse(f"{self.source} sets {key} = {value!r}, which the {self.family} mapping "
                         f"does not convert (it converts {shown}{why})",
                         "convert a model without it, or add its mapping in "
                         f"megatron/bounded/convert/{self.family}.py")

    def head_dim(self) -> int:
        return int(self.get("head_dim") or self["hidden_size"] // self["num_attention_heads"])

    def rope_parameters(self) -> dict:
        """``rope_parameters`` (transformers 5) over the older ``rope_scaling``."""
        parameters = dict(self.values.get("rope_parameters") or {})
        legacy = self.values.get("rope_scaling")
        return {**legacy, **parameters} if legacy else parameters

    def rope(self, kinds: Sequence[str] = ("default",),
             partial_default: float = 1.0) -> tuple[str, float, float]:
        """(kind, rope theta, fraction of each head that rotates, ``partial_default`` where the
        config does not say); a kind of scaling other than ``kinds`` (llama3, dynamic, ...; yarn
        where the family does not map it) is refused."""
        parameters = self.rope_parameters()
        kind = parameters.get("rope_type", parameters.get("type", "default"))
        if kind not in kinds:
            raise refuse(f"{self.source} asks for rope scaling of kind {kind!r} (rope_parameters/"
                         f"rope_scaling), which the {self.family} mapping does not map",
                         f"convert a model with rope_type {' or '.join(map(repr, kinds))}")
        theta = parameters.get("rope_theta", self.values.get("rope_theta", 10000.0))
        if float(theta) != int(theta):
            raise refuse(f"rope_theta = {theta} is not an integer (--rotary-base takes one)",
                         "convert a model whose rope_theta is a whole number")
        partial = parameters.get("partial_rotary_factor",
                                 self.values.get("partial_rotary_factor", partial_default))
        return kind, float(theta), float(partial)


@dataclass(frozen=True)
class Yarn:
    """YaRN's settings as megatron-core's YarnRotaryEmbedding takes them."""

    factor: float
    original_max_positions: int
    beta_fast: float
    beta_slow: float
    round_to_int: bool  # transformers' ``truncate``
    mscale: float
    mscale_all_dim: float


def yarn(config: HFConfig) -> Yarn:
    """transformers' YaRN parameters in megatron-core's terms. transformers scales cos/sin by
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) only when both are set, and by
    mscale(factor, 1) otherwise (megatron-core: ``--mscale 1 --mscale-all-dim 0``); an explicit
    ``attention_factor``, or ``mscale_all_dim`` without ``mscale`` (the softmax scale of MLA would
    then use it, the rotary scale not), has no megatron-core counterpart."""
    parameters = config.rope_parameters()
    if parameters.get("attention_factor") is not None:
        raise refuse("rope_parameters.attention_factor is set (megatron-core derives it from "
                     "factor, mscale and mscale_all_dim)", "convert a model without it")
    mscale, mscale_all_dim = parameters.get("mscale"), parameters.get("mscale_all_dim")
    if mscale_all_dim and not mscale:
        raise refuse(f"rope_parameters.mscale_all_dim = {mscale_all_dim} without mscale",
                     "convert a model with both or neither")
    if not (mscale and mscale_all_dim):
        mscale, mscale_all_dim = 1.0, 0.0
    original = int(parameters["original_max_position_embeddings"])
    factor = parameters.get("factor") or config["max_position_embeddings"] / original
    return Yarn(float(factor), original, float(parameters.get("beta_fast") or 32),
                float(parameters.get("beta_slow") or 1), bool(parameters.get("truncate", True)),
                float(mscale), float(mscale_all_dim))


SWIGLU_WITHOUT_BIASES = ("--swiglu", "--disable-bias-linear")


def swiglu_flags(config: HFConfig) -> list:
    config.require("hidden_act", ("silu",), default="silu", why=" (SwiGLU)")
    return list(SWIGLU_WITHOUT_BIASES)


def decoder_flags(config: HFConfig, *, attention: list, mlp: Sequence[str]) -> list:
    """Flags of the norms, embeddings and sizes every family here shares, with the family's
    ``attention`` and ``mlp`` flags."""
    flags = [
        "--num-layers", config["num_hidden_layers"], "--hidden-size", config["hidden_size"],
        "--num-attention-heads", config["num_attention_heads"],
        "--max-position-embeddings", config["max_position_embeddings"],
        "--normalization", "RMSNorm", "--norm-epsilon", config["rms_norm_eps"],
        "--padded-vocab-size", config["vocab_size"],
        "--attention-dropout", config.get("attention_dropout", 0.0), "--hidden-dropout", 0,
        *attention, *mlp,
    ]
    if not config.get("tie_word_embeddings", False):
        flags += ["--untie-embeddings-and-output-weights"]
    return [str(flag) for flag in flags]


def rope_flags(config: HFConfig, partial_default: float = 1.0) -> list:
    """Plain rotary embeddings (rotate-half) on ``partial_rotary_factor`` of each head
    (``partial_default``: transformers' value for the family where the config has none)."""
    _, theta, partial = config.rope(partial_default=partial_default)
    flags = ["--position-embedding-type", "rope", "--rotary-base", int(theta)]
    return flags + (["--rotary-percent", partial] if partial != 1.0 else [])


def gqa_flags(config: HFConfig, *, qk_norm: bool, qkv_bias: bool) -> list:
    """Grouped-query attention: heads of ``head_dim``, norms on query and key heads, QKV bias."""
    heads = config["num_attention_heads"]
    groups = config.get("num_key_value_heads") or heads
    flags = ["--kv-channels", config.head_dim()]
    if groups != heads:
        flags += ["--group-query-attention", "--num-query-groups", groups]
    if qk_norm:
        flags += ["--qk-layernorm"]
    if qkv_bias:
        flags += ["--add-qkv-bias"]
    return flags


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
    # list of tensors -> None; raises a ConversionError for tensors join would not keep exactly
    # (run by the import before it writes anything)
    check: Optional[Callable] = None


def same(key: str, hf_name: str) -> Rule:
    return Rule(key, (hf_name,), lambda tensors: tensors[0], lambda tensor: [tensor])


def concatenated(key: str, hf_names: Sequence[str],
                 widths: Optional[Sequence[int]] = None) -> Rule:
    """Ours is the Hugging Face tensors one after the other along dim 0 (fc1: gate, then up), of
    ``widths`` rows each, or of equal parts when not given."""
    names = tuple(hf_names)

    def split(tensor):
        return list(torch.split(tensor, list(widths) if widths else tensor.shape[0] // len(names)))

    return Rule(key, names, lambda tensors: torch.cat(tensors), split)


def grouped_qkv(key: str, q: str, k: str, v: str, heads: int, groups: int, head_dim: int,
                gated: bool = False) -> Rule:
    """megatron-core's fused QKV (weight or bias): per query group, its query heads, key, value.
    ``gated`` (``--attention-output-gate``): the query projection holds, per head, the query's
    rows then its output gate's (transformers' Qwen3-Next), and megatron-core's group is its
    query heads, their gates, key, value."""
    per_group, parts = heads // groups, 2 if gated else 1
    widths = [per_group * head_dim] * parts + [head_dim, head_dim]

    def join(tensors):
        query, key_, value = tensors
        rest = query.shape[1:]
        by_head = query.reshape(groups, per_group, parts, head_dim, *rest)
        queries = [by_head[:, :, part].reshape(groups, per_group * head_dim, *rest)
                   for part in range(parts)]
        return torch.cat([*queries, key_.reshape(groups, head_dim, *rest),
                          value.reshape(groups, head_dim, *rest)], dim=1).reshape(-1, *rest)

    def split(tensor):
        rest = tensor.shape[1:]
        *queries, key_, value = torch.split(tensor.reshape(groups, sum(widths), *rest), widths, 1)
        query = torch.stack([part.reshape(groups, per_group, head_dim, *rest)
                             for part in queries], dim=2)
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
    # every expert in two tensors (instead of ``expert``'s, one per expert and projection): the
    # [E, 2F, hidden] gate-and-up (each expert's gate rows, then its up rows: our fc1) and the
    # [E, hidden, F] down projection, e.g. ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    fused_experts: Optional[tuple] = None


def attention_rules(config: HFConfig, layer: int, *, qk_norm: bool, qkv_bias: bool,
                    gated: bool = False) -> list:
    ours, hf = f"decoder.layers.{layer}.self_attention.", f"model.layers.{layer}.self_attn."
    heads = config["num_attention_heads"]
    groups = config.get("num_key_value_heads") or heads
    shape = dict(heads=heads, groups=groups, head_dim=config.head_dim(), gated=gated)
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


def mlp_norm_rule(layer: int, fused: bool) -> Rule:
    """The norm before the MLP: fused into ``linear_fc1`` (this project's GQA layers) or the
    layer's ``pre_mlp_layernorm`` (the multi-latent attention layers)."""
    key = (f"decoder.layers.{layer}.mlp.linear_fc1.layer_norm_weight" if fused
           else f"decoder.layers.{layer}.pre_mlp_layernorm.weight")
    return same(key, f"model.layers.{layer}.post_attention_layernorm.weight")


def dense_mlp_rules(layer: int, names: DecoderNames, fused_norm: bool = True) -> list:
    ours, hf = f"decoder.layers.{layer}.mlp.", f"model.layers.{layer}.mlp."
    return [
        mlp_norm_rule(layer, fused_norm),
        concatenated(f"{ours}linear_fc1.weight",
                     [f"{hf}{names.gate}.weight", f"{hf}{names.up}.weight"]),
        same(f"{ours}linear_fc2.weight", f"{hf}{names.down}.weight"),
    ]


def moe_rules(layer: int, names: DecoderNames, num_experts: int, fused_norm: bool = True) -> list:
    ours, hf = f"decoder.layers.{layer}.mlp.", f"model.layers.{layer}."
    fc1, fc2 = (f"{ours}experts.experts.linear_fc{i}.weight" for i in (1, 2))
    if names.fused_experts:
        gate_up, down = names.fused_experts
        experts = [same(fc1, hf + gate_up), same(fc2, hf + down)]
    else:
        expert = hf + names.expert.replace("{proj}", "{proj_}")
        experts = [stacked_experts(fc1, [expert.replace("{proj_}", names.gate),
                                         expert.replace("{proj_}", names.up)], num_experts),
                   stacked_experts(fc2, [expert.replace("{proj_}", names.down)], num_experts)]
    rules = [mlp_norm_rule(layer, fused_norm), same(f"{ours}router.weight", hf + names.router),
             *experts]
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
