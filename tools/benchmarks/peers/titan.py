"""torchtitan's Qwen3 model with MoE (``torchtitan.models.qwen3``, torchtitan 0.2.2: the release
that runs on torch 2.11) with the workload's weights, read through torchtitan's own Hugging Face
state-dict adapter, trained by the loop of :mod:`peers.training`.

Set up by torchtitan's own ``parallelize_qwen3`` on one GPU (no sharding: FSDP, TP, CP and EP of
degree 1): full activation checkpointing and ``torch.compile`` of each block, as the job config
asks; its grouped experts (``torch._grouped_mm``, in bf16); fp32 weights under bf16 autocast, which
is what torchtitan's ``maybe_enable_amp`` gives a single device; its cross-entropy (on the fp32
logits, summed) over the micro-batch's tokens. The load-balancing bias of its router is off
(``load_balance_coeff=None``): Qwen3's router has none.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from peers.training import Update, train


@dataclass(frozen=True)
class Settings:
    activation_checkpoint: str = "full"
    compile: bool = True
    grouped_mm: bool = True
    precision: str = "autocast"
    max_micro_tokens: int = 32_768


SYSTEMS = {"torchtitan": Settings()}


def model_args(workload, seq_length: int, grouped_mm: bool):
    """torchtitan's ``Qwen3ModelArgs`` of the workload's config.json."""
    import transformers
    from torchtitan.models.moe import MoEArgs
    from torchtitan.models.qwen3 import Qwen3ModelArgs

    config = transformers.AutoConfig.from_pretrained(workload.hf_dir)
    return Qwen3ModelArgs(
        vocab_size=config.vocab_size, dim=config.hidden_size, n_layers=config.num_hidden_layers,
        n_heads=config.num_attention_heads, n_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim, hidden_dim=config.intermediate_size, norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_parameters["rope_theta"], qk_norm=True, max_seq_len=seq_length,
        attn_type="sdpa", enable_weight_tying=config.tie_word_embeddings, moe_enabled=True,
        moe_inter_dim=config.moe_intermediate_size,
        moe_args=MoEArgs(num_experts=config.num_experts, num_shared_experts=0,
                         top_k=config.num_experts_per_tok, score_func="softmax",
                         route_norm=config.norm_topk_prob, route_scale=1.0,
                         score_before_experts=False, use_grouped_mm=grouped_mm,
                         load_balance_coeff=None))


def build_model(workload, seq_length: int, device, grouped_mm: bool = True):
    """torchtitan's Qwen3 model (fp32) holding the workload's weights."""
    from safetensors.torch import load_file
    from torchtitan.models.qwen3 import Qwen3Model, Qwen3StateDictAdapter

    args = model_args(workload, seq_length, grouped_mm)
    with torch.device("meta"):
        model = Qwen3Model(args)
    model.to_empty(device=device)
    with torch.no_grad():  # as torchtitan's trainer does; what counts here is the rotary cache
        model.init_weights(buffer_device=torch.device(device))
    hf_state = {}
    for path in sorted(workload.hf_dir.glob("*.safetensors")):
        hf_state.update(load_file(path))
    model.load_state_dict(Qwen3StateDictAdapter(args, None).from_hf(hf_state), strict=True)
    return model


def parallelize(model, seq_length: int, settings: Settings):
    """torchtitan's own set-up of the model for one GPU, from its job config."""
    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.qwen3 import parallelize_qwen3

    job = JobConfig()
    job.training.seq_len = seq_length
    job.activation_checkpoint.mode = settings.activation_checkpoint
    job.compile.enable = settings.compile
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    return parallelize_qwen3(model, dims, job), job


def run(system: str, workload, dataset, seq_length: int, global_batch: int, steps: int,
        device, settings: Settings = None) -> tuple:
    """Train ``system`` (or ``settings``); (settings as recorded, measurements)."""
    from torchtitan.components.loss import build_cross_entropy_loss

    settings = settings or SYSTEMS[system]
    model, job = parallelize(build_model(workload, seq_length, device, settings.grouped_mm),
                             seq_length, settings)
    model.train()
    cross_entropy = build_cross_entropy_loss(job)

    def loss_of(tokens, labels):
        return cross_entropy(model(tokens), labels) / (labels != -100).sum()

    measured = train(loss_of, Update(model, settings.precision, device), dataset, steps,
                     global_batch, seq_length, settings.max_micro_tokens, device)
    return asdict(settings), measured
